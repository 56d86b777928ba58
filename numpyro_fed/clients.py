"""Horizontally partitioned data: one entry of model arguments per client."""

from __future__ import annotations

from typing import Any, Dict, Iterator, Mapping, NamedTuple, Sequence, Tuple, Union

import jax
import numpy as np

__all__ = ["ClientData", "Clients"]

_EMPTY = "Clients needs at least one client; got an empty mapping"
_NOT_MAPPING = (
    "client '{client}' must be a mapping of argument name -> array, e.g. "
    "dict(X=..., y=...); got {kind}"
)
_NO_ARGS = "client '{client}' has no arguments; give it at least one data array"
_NAMES = (
    "client '{client}' has arguments {got} but client '{first}' has {want}; every "
    "client must pass the same argument names to the model"
)
_SCALAR = (
    "argument '{arg}' of client '{client}' is a scalar; client arguments must be arrays "
    "whose leading axis indexes rows (pass shared constants to the model as "
    "model_kwargs= of the inference object instead)"
)
_ROWS = (
    "client '{client}' has {counts} rows across its arguments; every argument of a "
    "client must have the same leading (row) dimension"
)
_EMPTY_CLIENT = "client '{client}' has no rows; drop it or give it data"
_TRAILING = (
    "argument '{arg}' has trailing shape {got} on client '{client}' but {want} on "
    "client '{first}'; all clients must agree on everything but the number of rows"
)
_NONFINITE = (
    "argument '{arg}' of client '{client}' holds {count} non-finite value(s) (NaN/inf); "
    "clean or impute them before federating"
)
_DTYPE = (
    "argument '{arg}' of client '{client}' has dtype {dtype}; client data must be numeric arrays "
    "(bool, integer or float): convert categories to integer codes or one-hot columns first"
)
_SPLIT_LEN = (
    "Clients.split: argument '{arg}' has {got} rows but group_ids has {want}; "
    "group_ids needs one entry per row"
)


class ClientData(NamedTuple):
    """What one client holds as the simulation lays it out: its model arguments (padded
    to a common row count under ``vmap``), the row mask (0 on padded rows) and its real
    row count."""

    args: Dict[str, jax.Array]
    row_mask: jax.Array
    num_rows: jax.Array


_SAME_NAME = (
    "two clients are both named {client!r} once their names are strings (keys of types {kinds}, e.g. 0 and '0'); "
    "client names must stay distinct after str(): rename one"
)


class Clients(Mapping[str, Dict[str, np.ndarray]]):
    """Data held by each client, as keyword arguments of the model.

    The leading axis of every array indexes the client's rows (observations, or units
    such as patients when a unit has several observations). Clients may hold different
    numbers of rows but must agree on argument names and trailing shapes.

    The arrays are copied (and the copies made read-only), so later changes to the
    caller's arrays do not reach the clients; every argument of every client must be
    numeric (bool, integer or float) and finite.

    Args:
        data: mapping ``client name -> {argument name: array}``.

    Examples:
        >>> import numpy as np
        >>> import numpyro_fed as nf
        >>> clients = nf.Clients({"a": dict(y=np.zeros(3)), "b": dict(y=np.ones(2))})
        >>> clients.names, clients.num_rows
        (('a', 'b'), {'a': 3, 'b': 2})
    """

    def __init__(self, data: Mapping[str, Mapping[str, object]]) -> None:
        if not isinstance(data, Mapping):
            raise TypeError(f"Clients expects a mapping client -> arguments; got {type(data).__name__}")
        if len(data) == 0:
            raise ValueError(_EMPTY)
        clean: Dict[str, Dict[str, np.ndarray]] = {}
        first = None
        for key, args in data.items():
            client = str(key)
            if client in clean:  # 0 and "0" would both become client "0"; the second would drop the first
                raise ValueError(_SAME_NAME.format(client=client, key=key, kinds=sorted(
                    {type(k).__name__ for k in data if str(k) == client})))
            if not isinstance(args, Mapping):
                raise TypeError(_NOT_MAPPING.format(client=client, kind=type(args).__name__))
            if len(args) == 0:
                raise ValueError(_NO_ARGS.format(client=client))
            arrays = {}
            for arg, value in args.items():
                arr = np.array(value, copy=True)  # the caller's later writes do not reach us
                if arr.dtype.kind not in "biuf":
                    raise TypeError(_DTYPE.format(arg=arg, client=client, dtype=arr.dtype))
                if arr.ndim == 0:
                    raise ValueError(_SCALAR.format(arg=arg, client=client))
                if arr.dtype.kind == "f":
                    bad = int(np.size(arr) - np.count_nonzero(np.isfinite(arr)))
                    if bad:
                        raise ValueError(_NONFINITE.format(arg=arg, client=client, count=bad))
                arr.setflags(write=False)
                arrays[str(arg)] = arr
            rows = {a: v.shape[0] for a, v in arrays.items()}
            if len(set(rows.values())) != 1:
                raise ValueError(_ROWS.format(client=client, counts=rows))
            if next(iter(rows.values())) == 0:
                raise ValueError(_EMPTY_CLIENT.format(client=client))
            if first is None:
                first = client
            else:
                ref = clean[first]
                if sorted(ref) != sorted(arrays):
                    raise ValueError(
                        _NAMES.format(client=client, got=sorted(arrays), first=first, want=sorted(ref))
                    )
                for arg, arr in arrays.items():
                    if arr.shape[1:] != ref[arg].shape[1:]:
                        raise ValueError(
                            _TRAILING.format(
                                arg=arg, got=arr.shape[1:], client=client,
                                want=ref[arg].shape[1:], first=first,
                            )
                        )
            clean[client] = arrays
        self._data = clean
        #: per client, the pooled values of its recoded group columns (see :meth:`split`)
        self.group_values: Dict[str, Dict[str, np.ndarray]] = {c: {} for c in clean}

    @classmethod
    def split(cls, group_ids: Any, *, groups: Union[str, Sequence[str], None] = None, **arrays: Any) -> "Clients":
        """Split pooled arrays into clients by a group vector.

        Rows with the same value of ``group_ids`` go to the same client, named
        ``str(group)``; clients are ordered by sorted group value and keep their rows in
        their original order.

        Args:
            group_ids: each row's client.
            groups: the name (or names) of arguments holding a group code per row within
                the client (wards of a hospital, for :func:`numpyro_fed.group_plate`): each
                client's codes are recoded to ``0 .. G_j - 1`` in sorted order of the pooled
                values (the pooled values of client ``c``'s groups are
                ``clients.group_values[c][name]``).
            arrays: the model's data arguments, one row per entry of ``group_ids``.

        Examples:
            >>> import numpy as np
            >>> import numpyro_fed as nf
            >>> c = nf.Clients.split(np.array([1, 0, 1]), y=np.array([1.0, 2.0, 3.0]))
            >>> c["1"]["y"]
            array([1., 3.])
            >>> w = nf.Clients.split(np.array([0, 0, 1, 1]), groups="ward", ward=np.array([7, 3, 7, 9]),
            ...                      y=np.zeros(4))
            >>> w["0"]["ward"], w["1"]["ward"], w.group_values["1"]["ward"]
            (array([1, 0]), array([0, 1]), array([7, 9]))
        """
        group_ids = np.asarray(group_ids)
        if group_ids.ndim != 1:
            raise ValueError(f"Clients.split: group_ids must be 1-D; got shape {group_ids.shape}")
        if not arrays:
            raise ValueError("Clients.split needs at least one data array, e.g. Clients.split(g, X=X, y=y)")
        for arg, value in arrays.items():
            n = np.shape(value)[0] if np.ndim(value) else None
            if n != group_ids.shape[0]:
                raise ValueError(_SPLIT_LEN.format(arg=arg, got=n, want=group_ids.shape[0]))
        coded = [groups] if isinstance(groups, str) else list(groups or [])
        for name in coded:
            if name not in arrays:
                raise ValueError(f"Clients.split: groups={name!r} is not one of the arrays {sorted(arrays)}")
            if np.ndim(arrays[name]) != 1:
                raise ValueError(f"Clients.split: groups={name!r} must be one code per row (1-D); "
                                 f"got shape {np.shape(arrays[name])}")
        data, values = {}, {}
        for g in np.unique(group_ids):
            idx = np.flatnonzero(group_ids == g)
            data[str(g)] = {k: np.asarray(v)[idx] for k, v in arrays.items()}
            values[str(g)] = {}
            for name in coded:  # the client's own codes 0 .. G_j - 1
                values[str(g)][name], data[str(g)][name] = np.unique(data[str(g)][name], return_inverse=True)
        out = cls(data)
        out.group_values = values
        return out

    # Mapping interface -------------------------------------------------------------
    def __getitem__(self, client: str) -> Dict[str, np.ndarray]:
        try:
            return self._data[client]
        except KeyError:
            raise KeyError(f"no client named {client!r}; clients are {list(self._data)}") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __repr__(self) -> str:
        rows = ", ".join(f"{k}: {v}" for k, v in self.num_rows.items())
        return f"Clients({len(self)} clients; rows {{{rows}}})"

    # Metadata the server may know ----------------------------------------------------
    @property
    def names(self) -> Tuple[str, ...]:
        return tuple(self._data)

    @property
    def arg_names(self) -> Tuple[str, ...]:
        return tuple(next(iter(self._data.values())))

    @property
    def num_rows(self) -> Dict[str, int]:
        return {k: int(next(iter(v.values())).shape[0]) for k, v in self._data.items()}

    @property
    def total_rows(self) -> int:
        return sum(self.num_rows.values())

    def pooled(self) -> Dict[str, np.ndarray]:
        """All clients' rows concatenated (for centralised reference fits only)."""
        return {
            arg: np.concatenate([self._data[c][arg] for c in self._data]) for arg in self.arg_names
        }
