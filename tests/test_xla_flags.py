"""numpyro_fed turns off YNNPACK's reduce fusion in XLA's CPU compiler on import (jaxlib 0.10),
and leaves XLA_FLAGS alone where the user chose, opted out or JAX had already started.

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
import jax, jax.numpy as jnp
f = jax.jit(lambda a, b: jnp.sum(a * b, axis=-1))  # a client's sum over its rows, vectorised over clients
text = f.lower(jnp.ones((1000, 10)), jnp.ones((1000, 10))).compile().as_text()
print(json.dumps(dict(flags=os.environ.get("XLA_FLAGS", ""), applied=nf._xla.applied, ynn="__ynn_fusion" in text)))
"""


def _probe(env=None, before=""):
    env = {k: v for k, v in os.environ.items()  # the fusion is looked for in XLA's optimised program
           if k not in ("XLA_FLAGS", _xla.OPT_OUT, "JAX_DISABLE_MOST_OPTIMIZATIONS")} | (env or {})
    out = subprocess.run([sys.executable, "-c", PROBE.format(before=before)], capture_output=True, text=True,
                         env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


measured = tuple(int(x) for x in jaxlib.__version__.split(".")[:2]) == (0, 10)


@pytest.mark.skipif(not measured, reason="the flag is set on jaxlib 0.10.x only")
def test_import_turns_ynn_reduce_fusion_off():
    got = _probe()
    assert got["applied"] and _xla.FLAG in got["flags"] and not got["ynn"]


@pytest.mark.skipif(not measured, reason="the flag is set on jaxlib 0.10.x only")
@pytest.mark.parametrize("case", ["opt_out", "user_choice", "jax_already_started"])
def test_xla_flags_are_left_alone(case):
    if case == "opt_out":
        got = _probe({_xla.OPT_OUT: "0"})
    elif case == "user_choice":
        got = _probe({"XLA_FLAGS": "--xla_cpu_experimental_ynn_fusion_type=reduce"})
    else:
        got = _probe(before="import jax.numpy as jnp; jnp.ones(2).sum()")
    assert not got["applied"] and _xla.FLAG not in got["flags"]
    assert got["ynn"]  # YNN's reduce fusion is XLA's default here: the probe sees the difference
