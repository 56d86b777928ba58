"""The runtime every family shares: one result type, checkpoints that resume exactly in a
new process, guards that name the round and the clients, and the byte rule."""

import json
import os
import pathlib
import subprocess
import sys

import jax
import numpy as np
import numpyro
import numpyro.distributions as dist
import optax
import pytest
from jax import random

import numpyro_fed as nf
from numpyro_fed.run.inference import fitted

from .families import FAMILIES, horizontal_data, linear, run

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_returns_the_same_result_through_one_backend(family):
    inference, inputs = FAMILIES[family]()
    calls = []
    res = run(inference, inputs, random.PRNGKey(0), 3, callbacks=[lambda r, s, i: calls.append(r)])
    assert isinstance(res, nf.RunResult) and res._fields == nf.RunResult._fields
    # an open-ended family (the Laplace search) may stop before its cap, once it is done
    rounds = int(res.state.round)
    assert isinstance(res.state, nf.RunState) and (rounds == 3 or (inference.open_ended and 1 <= rounds < 3))
    assert res.trace.shape == (rounds,) and np.isfinite(res.trace).all()
    assert res.communication.rounds == rounds and res.communication.bytes_up > 0
    assert set(res.client_states) == set(fitted(inference).plan.names)
    assert calls == list(range(1, rounds + 1))  # callbacks see every round
    assert jax.tree_util.tree_leaves(res.params)


def _params_npz(res):
    flat, _ = jax.tree_util.tree_flatten_with_path(res.params)
    return {jax.tree_util.keystr(p): np.asarray(v) for p, v in flat}


RESUME = """
import sys, numpy as np, jax
from jax import random
sys.path.insert(0, {root!r})
from tests.families import FAMILIES, load, run
for family in {families!r}:
    inference, inputs = FAMILIES[family]()
    state = load(inference, inputs, {path!r} + family + ".npz")
    res = run(inference, inputs, None, {rest}, init_state=state, callbacks=[lambda *a: None])
    flat, _ = jax.tree_util.tree_flatten_with_path(res.params)
    np.savez({path!r} + family + "_resumed.npz", **{{jax.tree_util.keystr(p): np.asarray(v) for p, v in flat}})
"""


def test_checkpoint_resumed_in_a_new_process_gives_the_uninterrupted_parameters(tmp_path):
    """For every family: a 5-round run saves its state after round 2; resumed from that file
    for 3 rounds in a fresh Python process, it ends exactly where the uninterrupted run did.
    (Both runs step round by round, the path callbacks take, so they run the same compiled
    round.)"""
    families = sorted(FAMILIES)
    full = {}
    for family in families:
        inference, inputs = FAMILIES[family]()
        path = str(tmp_path / f"{family}.npz")

        def save_at_2(rnd, state, info, inference=inference, path=path):
            if rnd == 2:
                inference.save(path, state)

        full[family] = _params_npz(run(inference, inputs, random.PRNGKey(0), 5, callbacks=[save_at_2]))
    script = RESUME.format(root=str(ROOT), families=families, path=str(tmp_path) + "/", rest=3)
    # The new process inherits this one's whole environment: JAX's CPU triangular solves call the
    # BLAS of SciPy's OpenBLAS, whose kernel choice (OPENBLAS_CORETYPE) moves a result by an ulp
    # (measured: a 40 x 40 float32 solve). A resume is exact under the same libraries' settings.
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    for family in families:
        with np.load(tmp_path / f"{family}_resumed.npz") as resumed:
            assert set(resumed.files) == set(full[family]), family
            for name, value in full[family].items():
                np.testing.assert_array_equal(resumed[name], value, err_msg=f"{family} {name}")


def test_checkpoint_format_and_client_mismatch(tmp_path):
    inference, clients = FAMILIES["sfvi"]()
    path = str(tmp_path / "state.npz")
    res = run(inference, clients, random.PRNGKey(0), 4, checkpoint=path, checkpoint_every=2)
    with np.load(path) as archive:
        meta = json.loads(str(archive["meta"]))
        assert meta["round"] == 4 and meta["clients"] == ["0", "1", "2"] and meta["family"] == "sfvi"
        assert "clients/1/.rng_key" in archive.files  # each client's own key, by name
    other = horizontal_data(sizes=(12, 9, 7, 5))
    fresh, _ = FAMILIES["sfvi"]()
    with pytest.raises(ValueError, match=r"missing from this run: \[\]; not in the checkpoint: \['3'\]"):
        fresh.load(path, other)
    loaded = fresh.load(path, clients)
    np.testing.assert_array_equal(loaded.server.global_params["guide"]["loc"], res.params.guide["loc"])
    pvi, _ = FAMILIES["pvi"]()
    with pytest.raises(ValueError, match="is of a sfvi run, not pvi"):
        pvi.load(path, clients)


def test_checkpoint_does_not_depend_on_the_client_mapping(tmp_path):
    clients = horizontal_data(sizes=(8, 8, 8))
    vmap = nf.FederatedSVI(linear, nf.StructuredGuide(linear), optax.adam(0.05))
    loop = nf.FederatedSVI(linear, nf.StructuredGuide(linear), optax.adam(0.05), client_mapping="loop")
    path = str(tmp_path / "s.npz")
    a = vmap.run(random.PRNGKey(0), clients, 3, progress_bar=False, checkpoint=path)
    state = loop.load(path, clients)
    assert fitted(loop).plan.mapping == "loop" and type(state.clients) is tuple
    b = loop.run(None, clients, 3, progress_bar=False, init_state=state)
    c = vmap.run(random.PRNGKey(0), clients, 6, progress_bar=False)
    np.testing.assert_allclose(b.params.guide["loc"], c.params.guide["loc"], rtol=1e-5)
    assert a.communication.rounds == 3


def logistic(x, y):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
    with numpyro.plate("rows", y.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=x @ w), obs=y)


@pytest.fixture(scope="module")
def binary():
    rng = np.random.default_rng(2)
    x = (10 * rng.normal(size=(40, 2))).astype(np.float32)
    y = (rng.random(40) < 0.5).astype(np.float32)
    return nf.Clients.split(np.repeat([0, 1, 2, 3], 10), x=x, y=y)


@pytest.mark.parametrize("progress_bar", [False, True])
def test_exploding_optimiser_stops_with_the_round(binary, progress_bar):
    svi = nf.FederatedSVI(logistic, nf.StructuredGuide(logistic), optax.sgd(1e8))
    with pytest.raises(nf.run.backends.NonFiniteError, match=r"round \d+: non-finite values") as err:
        svi.run(random.PRNGKey(0), binary, 200, progress_bar=progress_bar)
    assert 1 <= err.value.round < 200
    last = err.value.state
    assert int(last.round) == err.value.round - 1  # the last finite state, not the broken one
    assert all(np.isfinite(x).all() for x in jax.tree_util.tree_leaves(last.server.global_params))


def test_nonfinite_can_warn_and_keep_the_finite_rounds(binary):
    svi = nf.FederatedSVI(logistic, nf.StructuredGuide(logistic), optax.sgd(1e8))
    with pytest.warns(nf.warnings.NonFiniteWarning, match=r"round (\d+): non-finite"):
        res = svi.run(random.PRNGKey(0), binary, 200, progress_bar=False, on_nonfinite="warn")
    assert res.trace.shape[0] == int(res.state.round) < 200
    assert np.isfinite(res.trace).all()


def test_nonfinite_names_the_client(tmp_path):
    """A client whose data make its messages non-finite is named (data that overflow float32)."""

    def model(x, y):
        w = numpyro.sample("w", dist.Normal(0.0, 1.0))
        with numpyro.plate("rows", y.shape[0]):
            numpyro.sample("y", dist.Normal(w * x, 1.0), obs=y)

    x = np.ones(20, np.float32)
    x[15:] = 3e38  # client '3' only
    clients = nf.Clients.split(np.repeat([0, 1, 2, 3], 5), x=x, y=np.ones(20, np.float32))
    svi = nf.FederatedSVI(model, nf.StructuredGuide(model), optax.adam(0.01))
    with pytest.raises(nf.run.backends.NonFiniteError, match=r"round 1: .*client\(s\) \['3'\]") as err:
        svi.run(random.PRNGKey(0), clients, 5, progress_bar=False)
    assert err.value.clients == ["3"]


def test_pvi_that_never_applies_an_update_raises_and_a_dead_round_warns():
    """Local fits that diverge (sgd(1e6)) send invalid updates: a fit that never applied one
    raises instead of returning the prior; resumed from a moved q it warns per round."""
    clients = horizontal_data()
    broken = nf.PVI(linear, update="optax", optim=optax.sgd(1e6), local_steps=5)
    with pytest.raises(ValueError, match=r"PVI applied no update in 3 round\(s\): q is still the prior"):
        broken.run(random.PRNGKey(0), clients, 3)
    good = nf.PVI(linear, update="optax", optim=optax.adam(0.05), local_steps=20)
    moved = good.run(random.PRNGKey(0), clients, 1)
    with pytest.warns(nf.warnings.InvalidUpdateWarning,
                      match=r"in round\(s\) \[2, 3\] every update that arrived was invalid"):
        broken.run(None, clients, 2, init_state=moved.state)


def test_byte_counts_are_the_serialised_sizes():
    """Communication counts the exact length of each message as serialised (numpy.save per
    leaf), and the transcript's sizes add up to the same totals."""
    inference, clients = FAMILIES["sfvi_avg"]()
    res = run(inference, clients, random.PRNGKey(0), 4, record_transcript=True, keep_values=True)
    t = res.transcript
    assert t.bytes_up == res.communication.bytes_up and t.bytes_down == res.communication.bytes_down
    for e in t.entries[:10]:
        assert e.nbytes == len(nf.run.transcript.message_to_bytes(e.value))
    message = {"a": np.arange(3.0, dtype=np.float32), "b": np.ones((2, 2), np.int32)}
    blob = nf.run.transcript.message_to_bytes(message)
    assert len(blob) == nf.run.transcript.message_bytes(message)
    back = nf.run.transcript.message_from_bytes(message, blob)
    np.testing.assert_array_equal(back["b"], message["b"])


def test_the_wire_format_is_numpy_save_per_leaf_and_reads_any_npy_leaf():
    """``message_to_bytes`` writes exactly what ``numpy.save`` writes for each leaf (scalars,
    booleans, empty and transposed arrays included, the last in C order), and
    ``message_from_bytes`` reads it back with the shapes and dtypes of ``like``; a leaf whose
    header is not the one ``like`` predicts (a Fortran-ordered ``numpy.save``, another shape) is
    parsed as ``.npy``, and trailing bytes are refused."""
    import io

    message = {"a": np.arange(6.0).reshape(2, 3).T, "b": np.asarray(3, np.int32), "c": np.zeros((4, 0), np.float32),
               "d": np.array([True, False]), "e": np.float64(2.5)}
    blob = nf.run.transcript.message_to_bytes(message)
    saved = io.BytesIO()
    for leaf in jax.tree_util.tree_leaves(message):
        np.save(saved, np.ascontiguousarray(leaf) if np.ndim(leaf) else np.asarray(leaf), allow_pickle=False)
    assert blob == saved.getvalue() and len(blob) == nf.run.transcript.message_bytes(message)
    like = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype), message)
    back = nf.run.transcript.message_from_bytes(like, blob)
    for k, v in message.items():
        assert isinstance(back[k], np.ndarray) and back[k].shape == np.shape(v) and back[k].dtype == np.asarray(v).dtype
        np.testing.assert_array_equal(back[k], v)
    fortran = io.BytesIO()
    for leaf in jax.tree_util.tree_leaves(message):
        np.save(fortran, np.asarray(leaf), allow_pickle=False)  # "a" is Fortran-ordered here
    assert fortran.getvalue() != blob
    np.testing.assert_array_equal(nf.run.transcript.message_from_bytes(like, fortran.getvalue())["a"], message["a"])
    with pytest.raises(ValueError, match="bytes left over"):
        nf.run.transcript.message_from_bytes(like, blob + b"x")
    # the Flower record around it: read past numpy.save's header, or (another .npy version) parsed
    pytest.importorskip("flwr")
    from flwr.app import Array, ArrayRecord

    from numpyro_fed.flower.wire import from_record, to_record

    np.testing.assert_array_equal(from_record(like, to_record(message))["a"], message["a"])
    version2 = io.BytesIO()
    np.lib.format.write_array(version2, np.frombuffer(blob, np.uint8), version=(2, 0))
    record = ArrayRecord({"0": Array(dtype="uint8", shape=(len(blob),), stype="numpy.ndarray",
                                     data=version2.getvalue())})
    assert not version2.getvalue().startswith(nf.run.transcript.npy_header((len(blob),), "|u1"))
    np.testing.assert_array_equal(from_record(like, record)["a"], message["a"])
