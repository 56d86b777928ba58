"""Importing numpyro_fed changes no process-wide setting; ``nf.tune_cpu_flags()`` turns off
YNNPACK's reduce fusion in XLA's CPU compiler (jaxlib 0.10), and leaves XLA_FLAGS alone where the
user chose, opted out or JAX had already started.

Each case runs in a fresh interpreter: XLA reads its flags once per process."""

import json
import os
import subprocess
import sys

import jaxlib
import pytest

from numpyro_fed import _xla

PROBE = r"""
import json, os, sys
{before}
import numpyro_fed as nf
imported = os.environ.get("XLA_FLAGS", "")
applied = nf.tune_cpu_flags() if {tune} else False
import jax, jax.numpy as jnp
f = jax.jit(lambda a, b: jnp.sum(a * b, axis=-1))  # a client's sum over its rows, vectorised over clients
text = f.lower(jnp.ones((1000, 10)), jnp.ones((1000, 10))).compile().as_text()
print(json.dumps(dict(imported=imported, flags=os.environ.get("XLA_FLAGS", ""), applied=applied,
                      ynn="__ynn_fusion" in text)))
"""


def _probe(env=None, before="", tune=True):
    env = {k: v for k, v in os.environ.items()  # the fusion is looked for in XLA's optimised program
           if k not in ("XLA_FLAGS", _xla.OPT_OUT, "JAX_DISABLE_MOST_OPTIMIZATIONS")} | (env or {})
    out = subprocess.run([sys.executable, "-c", PROBE.format(before=before, tune=tune)], capture_output=True, text=True,
                         env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


measured = tuple(int(x) for x in jaxlib.__version__.split(".")[:2]) == (0, 10)


@pytest.mark.skipif(not measured, reason="the flag is set on jaxlib 0.10.x only")
def test_tune_cpu_flags_turns_ynn_reduce_fusion_off_and_importing_changes_nothing():
    got = _probe()
    assert got["imported"] == "" and got["applied"] and _xla.FLAG in got["flags"] and not got["ynn"]
    untouched = _probe(tune=False)
    assert untouched["flags"] == "" and untouched["ynn"]  # XLA's default, as the user's process had it


@pytest.mark.skipif(not measured, reason="the flag is set on jaxlib 0.10.x only")
@pytest.mark.parametrize("case", ["opt_out", "user_choice", "jax_already_started"])
def test_xla_flags_are_left_alone(case):
    if case == "opt_out":
        got = _probe({_xla.OPT_OUT: "0"})
    elif case == "user_choice":
        got = _probe({"XLA_FLAGS": "--xla_cpu_experimental_ynn_fusion_type=reduce"})
    else:
        got = _probe(before="import jax.numpy as jnp; jnp.ones(2).sum()")  # computed before the call
    assert not got["applied"] and _xla.FLAG not in got["flags"]
    assert got["ynn"]  # YNN's reduce fusion is XLA's default here: the probe sees the difference


CACHE_PROBE = r"""
import json, jax
import numpyro_fed as nf
f = jax.jit(lambda a: a * 2.0 + 1.0)
f(jax.numpy.ones(3)).block_until_ready()
print(json.dumps(dict(dir=nf.run.compilation_cache.cache_dir, config=jax.config.jax_compilation_cache_dir,
                      min_time=jax.config.jax_persistent_cache_min_compile_time_secs)))
"""


def test_one_setting_turns_the_persistent_compilation_cache_on(tmp_path):
    """``NUMPYRO_FED_COMPILATION_CACHE`` set: JAX's persistent cache points there, keeps every
    program (however quick its compilation), and a compiled program is written to it; unset:
    nothing changes."""
    from numpyro_fed.run.compilation_cache import ENV

    def probe(env):
        base = {k: v for k, v in os.environ.items() if k not in (ENV, "JAX_COMPILATION_CACHE_DIR")}
        out = subprocess.run([sys.executable, "-c", CACHE_PROBE], capture_output=True, text=True, env=base | env,
                             timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    cache = tmp_path / "cache"
    on = probe({ENV: str(cache)})
    assert on["dir"] == on["config"] == str(cache) and on["min_time"] == 0.0
    assert any(cache.iterdir())  # the program was written
    off = probe({})
    assert off["dir"] is None and not off["config"]
