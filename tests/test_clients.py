import numpy as np
import pytest

import numpyro_fed as nf


def test_split_and_metadata():
    g = np.array([2, 0, 2, 1, 0])
    X = np.arange(10.0).reshape(5, 2)
    c = nf.Clients.split(g, X=X, y=np.arange(5.0))
    assert c.names == ("0", "1", "2")
    assert c.num_rows == {"0": 2, "1": 1, "2": 2}
    assert c.total_rows == 5
    np.testing.assert_array_equal(c["2"]["y"], [0.0, 2.0])
    assert c.pooled()["y"].shape == (5,)


@pytest.mark.parametrize(
    "data, match",
    [
        ({}, "at least one client"),
        ({"a": dict(y=np.zeros(3)), "b": dict(x=np.zeros(3))}, "client 'b' has arguments"),
        ({"a": dict(X=np.zeros((3, 2))), "b": dict(X=np.zeros((3, 4)))}, "argument 'X' has trailing shape"),
        ({"a": dict(y=np.zeros(0))}, "client 'a' has no rows"),
        ({"a": dict(y=np.array([1.0, np.nan]))}, "argument 'y' of client 'a' holds 1 non-finite"),
        ({"a": dict(y=np.zeros(3), X=np.zeros((2, 1)))}, "client 'a' has .* rows"),
        ({"a": dict(y=1.0)}, "argument 'y' of client 'a' is a scalar"),
        ({"a": dict()}, "client 'a' has no arguments"),
    ],
)
def test_validation_errors(data, match):
    with pytest.raises(ValueError, match=match):
        nf.Clients(data)


def test_split_length_mismatch():
    with pytest.raises(ValueError, match="argument 'y' has 3 rows but group_ids has 2"):
        nf.Clients.split(np.array([0, 1]), y=np.zeros(3))


def test_unknown_client_key():
    c = nf.Clients({"a": dict(y=np.zeros(2))})
    with pytest.raises(KeyError, match="no client named 'z'"):
        c["z"]


def test_clients_copy_their_arrays():
    """Writing NaN into the caller's array afterwards changes nothing the clients hold."""
    y = np.arange(4.0)
    c = nf.Clients({"a": dict(y=y)})
    y[0] = np.nan
    assert np.isfinite(c["a"]["y"]).all() and c["a"]["y"][0] == 0.0
    with pytest.raises(ValueError, match="read-only"):
        c["a"]["y"][1] = 5.0


@pytest.mark.parametrize(
    "value, kind", [(np.array(["a", "b"]), "<U1"), (np.array([1.0, None], dtype=object), "object")]
)
def test_non_numeric_arguments_name_client_and_argument(value, kind):
    with pytest.raises(TypeError, match=f"argument 'g' of client 'b' has dtype {kind}"):
        nf.Clients({"a": dict(y=np.zeros(2), g=np.zeros(2)), "b": dict(y=np.zeros(2), g=value)})


def test_every_argument_of_every_client_is_checked_for_nan():
    data = {
        "a": dict(x=np.zeros((2, 2)), y=np.zeros(2)),
        "b": dict(x=np.array([[0.0, np.inf], [1.0, 1.0]]), y=np.zeros(2)),
    }
    with pytest.raises(ValueError, match="argument 'x' of client 'b' holds 1 non-finite"):
        nf.Clients(data)
