"""One privacy budget per client over every run its rows take part in.

A differentially private fit's guarantee (:meth:`~numpyro_fed.run.inference.FederatedInference.privacy_report`)
covers one run. The same rows fitted again (another model, more rounds, a second look) spend
more: the releases of every run compose. A :class:`PrivacyLedger` holds, per client, the
releases of every run charged to it and a budget; a run given ``ledger=`` is refused *before
it starts* when its planned releases, composed with the client's earlier ones, would exceed that
client's budget, naming the client, the epsilon spent and the epsilon asked. A run that starts
is charged its planned releases at once (so a run that fails midway stays charged, as an upper
bound); when it ends, its actual releases (each client's own count, as the run's privacy report
reads them) replace them, and :meth:`PrivacyLedger.report` gives each client's guarantee over
all its runs.

**Who a client is**: a run keys each client's releases by a fingerprint of the rows it holds
(:func:`fingerprint`: a hash of its data's arrays), not by the name the run gives it, so the same
rows under another name meet the same spend (a budget given per name is looked up by the name).
**Across processes**: with ``path=`` every check and charge holds an exclusive lock on
``path + ".lock"`` and reads the file again first, so two runs started at once on one ledger
cannot both pass on the same budget (the second sees the first's planned releases).

Composition is accounted with ``dp-accounting``'s privacy loss distribution
(:func:`~numpyro_fed.dp.accounting.epsilon_composed`) at the ledger's ``delta``, under
substitution of one row, as each run's own report is. With ``path=`` the ledger is kept in a
JSON file, written after every run and read when the ledger is made, so that it composes across
processes. A run's own ``dp_noise`` ``delta`` is its report's; the ledger accounts every run at
its own ``delta``.

Examples:
    >>> ledger = PrivacyLedger(epsilon=2.0, delta=1e-5)
    >>> ledger.charge("hospital A", [(10.0, 10, 1.0)], "a first fit")  # sigma/C 10, 10 releases
    >>> round(ledger.spent("hospital A"), 2)
    2.59
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import uuid
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

from .accounting import ClientPrivacy, PrivacyReport, epsilon_composed, report

__all__ = ["PrivacyBudgetError", "PrivacyLedger", "fingerprint"]

Event = Tuple[float, int, float]  # (sigma / C, releases, sampling rate), as epsilon_composed takes them

_OVER = (
    "{cls}: this run would take client '{client}' past its privacy budget: it has spent epsilon={spent:.4g} in "
    "{runs} earlier run(s), this run asks for epsilon={asked:.4g} on its own ({releases} release(s) at "
    "sigma/C={nm:.4g}), and together they reach epsilon={total:.4g}, over its budget of {budget:.4g} (delta="
    "{delta:g}). Nothing was sent. Fewer rounds or more noise (a smaller dp_noise(epsilon=...)) fit within the "
    "{left:.4g} left; or leave this client out"
)


def fingerprint(data: Mapping[str, Any]) -> str:
    """A client's identity from the rows it holds (``{name: array}``, as :class:`~numpyro_fed.Clients`
    keeps them): SHA-256 over the arrays' names, dtypes, shapes and bytes, in sorted order. The same
    rows give the same fingerprint under any client name."""
    h = hashlib.sha256()
    for key in sorted(data, key=str):
        arr = np.ascontiguousarray(np.asarray(data[key]))
        h.update(f"{key}:{arr.dtype.str}:{arr.shape};".encode())
        h.update(arr.tobytes() if arr.dtype != object else repr(arr.tolist()).encode())
    return "rows:" + h.hexdigest()[:32]


class PrivacyBudgetError(ValueError):
    """A run refused because a client's budget would be exceeded: ``client``, ``spent``
    (epsilon of its earlier runs), ``asked`` (this run's alone) and ``total`` (together)."""

    def __init__(self, message: str, client: str, spent: float, asked: float, total: float) -> None:
        super().__init__(message)
        self.client, self.spent, self.asked, self.total = client, spent, asked, total


class PrivacyLedger:
    """Per client: a privacy budget and the releases of every run charged to it.

    Args:
        epsilon: each client's budget (a number for all, or ``{client: epsilon}``; a client
            not named has no budget and is refused).
        delta: the delta every client's epsilon is accounted at (below ``1 / n`` for ``n`` rows).
        path: a JSON file to keep the ledger in (read now if it exists, written after every
            run), or ``None`` (this process only).

    Pass it to a private fit's run (``PVI``, ``BCM``, ``FederatedSVI``):
    ``pvi.run(key, clients, num_rounds, ledger=ledger)``.
    """

    def __init__(self, epsilon: Union[float, Mapping[str, float]], delta: float,
                 path: Optional[str] = None) -> None:
        if not 0 < float(delta) < 1:
            raise ValueError(f"PrivacyLedger(delta={delta!r}): must lie in (0, 1)")
        budgets = dict(epsilon) if isinstance(epsilon, Mapping) else None
        for value in (budgets.values() if budgets is not None else [epsilon]):
            if not (float(value) > 0 and math.isfinite(float(value))):
                raise ValueError(f"PrivacyLedger(epsilon={epsilon!r}): every budget must be a finite number > 0")
        self.budgets: Optional[Dict[str, float]] = None if budgets is None else {
            str(k): float(v) for k, v in budgets.items()}
        self.default = None if budgets is not None else float(epsilon)
        self.delta, self.path = float(delta), path
        self.runs: Dict[str, List[dict]] = {}  # client -> [{"run": label, "events": [[nm, releases, rate], ...]}]
        self.ids: Dict[str, str] = {}  # a run's client name -> the identity its releases are kept under
        self.names: Dict[str, List[str]] = {}  # identity -> the names it was charged under
        self._open: Dict[str, str] = {}  # identity -> the id of its run charged but not yet settled
        if path is not None and os.path.exists(path):
            self._load(path)

    def identify(self, name: str, identity: str) -> None:
        """Keep ``name``'s releases under ``identity`` (a :func:`fingerprint` of its rows)."""
        self.ids[str(name)] = str(identity)

    def identify_clients(self, clients: Any) -> None:
        """:meth:`identify` every client of ``clients`` (a :class:`~numpyro_fed.Clients`) by the
        :func:`fingerprint` of its rows; anything else (a network backend's list of names, whose
        rows stay on their nodes) leaves the names as the keys."""
        if isinstance(clients, Mapping) and hasattr(clients, "names"):  # the rows are here (not a network's names)
            for name in clients.names:
                self.identify(name, fingerprint(clients[name]))

    def _key(self, client: str) -> str:
        return self.ids.get(str(client), str(client))

    @contextlib.contextmanager
    def _locked(self):
        """Hold the ledger file's lock and read the file again (no file: nothing to hold)."""
        if self.path is None:
            yield
            return
        import fcntl

        with open(self.path + ".lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                if os.path.exists(self.path):
                    self._load(self.path)
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    # ------------------------------------------------------------------ reading
    def budget(self, client: str) -> float:
        """Client ``client``'s epsilon budget (``KeyError`` naming the budgets when it has none)."""
        if self.budgets is None:
            return self.default
        if client not in self.budgets:
            raise KeyError(f"PrivacyLedger: client '{client}' has no budget (budgets: {sorted(self.budgets)})")
        return self.budgets[client]

    def events(self, client: str) -> List[Event]:
        """Every release charged to ``client`` (its rows, under any name), over all its runs."""
        return [tuple(e) for run in self.runs.get(self._key(client), []) for e in run["events"]]

    def spent(self, client: str) -> float:
        """Epsilon at :attr:`delta` of all of ``client``'s recorded releases composed."""
        return epsilon_composed(self.events(client), self.delta)

    def report(self) -> PrivacyReport:
        """Each client's guarantee over every run charged to it (and the global one, by parallel
        composition: each row is held by one client)."""
        entries = []
        for key in sorted(self.runs, key=lambda k: " / ".join(self.names.get(k, [k]))):
            events = [tuple(e) for run in self.runs[key] for e in run["events"]]
            runs = self.runs[key]
            client = " / ".join(self.names.get(key, [key]))
            entries.append(ClientPrivacy(
                client, f"{len(runs)} run(s): " + "; ".join(r["run"] for r in runs),
                epsilon_composed(events, self.delta), self.delta,
                min(e[0] for e in events) if events else math.inf, sum(e[1] for e in events),
                max(e[2] for e in events) if events else 0.0))
        return report(entries)

    # ------------------------------------------------------------------ charging
    def check(self, cls: str, planned: Mapping[str, Sequence[Event]]) -> None:
        """Refuse (:class:`PrivacyBudgetError`) a run whose ``planned`` releases per client would
        take some client past its budget; the first such client (in order) is named."""
        for client, events in planned.items():
            events = [tuple(e) for e in events]
            budget = self.budget(client)
            total = epsilon_composed(self.events(client) + events, self.delta)
            if total > budget:
                spent = self.spent(client)
                asked = epsilon_composed(events, self.delta)
                nm = min((e[0] for e in events), default=math.inf)
                raise PrivacyBudgetError(
                    _OVER.format(cls=cls, client=client, spent=spent, runs=len(self.runs.get(self._key(client), [])),
                                 asked=asked, releases=sum(e[1] for e in events), nm=nm, total=total, budget=budget,
                                 delta=self.delta, left=max(budget - spent, 0.0)),
                    client, spent, asked, total)

    def charge(self, client: str, events: Sequence[Event], run: str, *, settle: bool = False) -> None:
        """Record ``events`` (a run's releases) against ``client``'s rows; written to :attr:`path`.
        ``settle``: they replace the record its open run charged (a run charged its planned
        releases before it started, and its actual ones when it ended)."""
        with self._locked():
            self._charge(client, events, run, settle)
            self._write()

    def _charge(self, client: str, events: Sequence[Event], run: str, settle: bool,
                opened: Optional[str] = None) -> str:
        key = self._key(client)
        runs = self.runs.setdefault(key, [])
        names = self.names.setdefault(key, [])
        if str(client) not in names:
            names.append(str(client))
        entry = {"run": str(run), "events": [[float(nm), int(c), float(r)] for nm, c, r in events]}
        opened = (self._open.pop(key, None) if opened is None else opened) if settle else None
        kept = [i for i, r in enumerate(runs) if opened is not None and r.get("id") == opened]
        if kept:
            runs[kept[0]] = entry
        else:
            runs.append(entry)
        if not settle:
            entry["id"] = uuid.uuid4().hex
            self._open[key] = entry["id"]
        return entry.get("id", "")

    def _write(self) -> None:
        if self.path is not None:
            self._save(self.path)

    def open_run(self, cls: str, planned: Mapping[str, Sequence[Event]], label: str) -> Dict[str, str]:
        """Before a run: :meth:`check` its planned releases, then charge them (a run that fails
        midway stays charged, as an upper bound); under the file's lock, the file read again first.
        Returns each client's charge id (:meth:`close_run` settles by them from another process)."""
        with self._locked():
            self.check(cls, planned)
            ids = {client: self._charge(client, events, f"{label} planned (unfinished)", False)
                   for client, events in planned.items()}
            self._write()
        return ids

    def close_run(self, actual: Mapping[str, Sequence[Event]], label: str,
                  ids: Optional[Mapping[str, str]] = None) -> None:
        """After a run: its actual releases replace the planned ones :meth:`open_run` charged
        (``ids``: its charge ids, where another ledger object opened the run)."""
        with self._locked():
            for client, events in actual.items():
                self._charge(client, events, label, True, None if ids is None else ids.get(client))
            self._write()

    # ------------------------------------------------------------------ file
    def _save(self, path: str) -> None:
        body = {"delta": self.delta, "budgets": self.budgets, "default": self.default, "runs": self.runs,
                "names": self.names}
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(body, f, indent=1)
        os.replace(tmp, path)

    def _load(self, path: str) -> None:
        with open(path) as f:
            body = json.load(f)
        if float(body["delta"]) != self.delta:
            raise ValueError(f"PrivacyLedger(path={path!r}): the file accounts at delta={body['delta']}, not "
                             f"{self.delta}; one ledger keeps one delta")
        self.runs = {str(k): list(v) for k, v in body["runs"].items()}
        self.names = {str(k): list(v) for k, v in body.get("names", {}).items()}

    def __repr__(self) -> str:
        return (f"PrivacyLedger({len(self.runs)} client(s), delta={self.delta:g}, "
                f"budget={self.default if self.budgets is None else self.budgets})")
