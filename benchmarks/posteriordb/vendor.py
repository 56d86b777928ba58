"""Copy what the suite uses from a checkout of stan-dev/posteriordb (BSD-3; see LICENCE).

Run once, by hand: ``python benchmarks/posteriordb/vendor.py /path/to/posteriordb.git``
(a bare repository or a clone). It writes, for each posterior in ``POSTERIORS``, the data
(``data/<data>.json``), the Stan program (``stan/<model>.stan``, to check the NumPyro
translations against) and, where the database has reference draws, their per-parameter
mean and sd (``reference/<posterior>.json``; the draws themselves are not copied). Nothing
is downloaded at run time.
"""

import io
import json
import pathlib
import subprocess
import sys
import zipfile

import numpy as np

WITH_REFERENCE = [
    "eight_schools-eight_schools_noncentered",
    "kidiq-kidscore_momhs", "kidiq-kidscore_momiq", "kidiq-kidscore_momhsiq",
    "kidiq-kidscore_interaction", "kidiq_with_mom_work-kidscore_mom_work",
    "kidiq_with_mom_work-kidscore_interaction_z",
    "earnings-earn_height", "earnings-logearn_height", "earnings-logearn_height_male",
    "earnings-logearn_interaction_z", "mesquite-logmesquite", "mesquite-logmesquite_logvolume",
    "nes2000-nes", "sblrc-blr", "sblri-blr", "kilpisjarvi_mod-kilpisjarvi",
]
WITHOUT_REFERENCE = [
    "radon_mn-radon_variable_intercept_noncentered", "surgical_data-surgical_model",
    "seeds_data-seeds_model", "rats_data-rats_model", "GLMM_Poisson_data-GLMM_Poisson_model",
]
POSTERIORS = WITH_REFERENCE + WITHOUT_REFERENCE
HERE = pathlib.Path(__file__).parent
DB = "posterior_database"


def _show(repo: str, path: str) -> bytes:
    return subprocess.run(["git", "--git-dir", repo, "show", f"HEAD:{path}"],
                          check=True, capture_output=True).stdout


def _unzip(blob: bytes):
    with zipfile.ZipFile(io.BytesIO(blob)) as z:
        return json.loads(z.read(z.namelist()[0]))


def main(repo: str) -> None:
    commit = subprocess.run(["git", "--git-dir", repo, "rev-parse", "HEAD"], check=True,
                            capture_output=True, text=True).stdout.strip()
    for sub in ("data", "stan", "reference"):
        (HERE / sub).mkdir(exist_ok=True)
    for name in POSTERIORS:
        meta = json.loads(_show(repo, f"{DB}/posteriors/{name}.json"))
        data = _unzip(_show(repo, f"{DB}/data/data/{meta['data_name']}.json.zip"))
        (HERE / "data" / f"{meta['data_name']}.json").write_text(json.dumps(data))
        stan = _show(repo, f"{DB}/models/stan/{meta['model_name']}.stan")
        (HERE / "stan" / f"{meta['model_name']}.stan").write_bytes(stan)
        if name in WITH_REFERENCE:
            chains = _unzip(_show(repo, f"{DB}/reference_posteriors/draws/draws/{name}.json.zip"))
            summary = {}
            for key in chains[0]:
                x = np.concatenate([np.asarray(c[key], float) for c in chains])
                summary[key] = {"mean": float(x.mean()), "sd": float(x.std(ddof=1))}
            out = {"posterior": name, "source": f"stan-dev/posteriordb@{commit}",
                   "ndraws": int(sum(len(c[next(iter(c))]) for c in chains)),
                   "summary": summary}
            (HERE / "reference" / f"{name}.json").write_text(json.dumps(out, indent=1))
    (HERE / "SOURCE").write_text(f"stan-dev/posteriordb {commit}\n")


if __name__ == "__main__":
    main(sys.argv[1])
