"""The design counts stay where the restructurings left them (``tools/design_counts.py``): no
private name crosses modules, no import cycle, no argument check written inline instead of
``numpyro_fed/_validation.py``'s, no function over 80 lines (its docstring not counted), one round
loop (the driver's), no public class more than three classes deep, no hand-set warning level and
no module over 600 lines, no backend reading an inference object's private state."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("design_counts", ROOT / "tools" / "design_counts.py")
design_counts = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(design_counts)

def test_the_package_keeps_its_design_counts():
    found = design_counts.counts()
    assert found["private_imports_across_modules"] == []
    assert found["import_cycles"] == []
    assert all(where == [] for where in found["inline_validation"].values()), found["inline_validation"]
    assert found["functions_over_80_lines"] == []
    assert [w.split(":")[0] for w in found["round_loops"]] == ["numpyro_fed/backends/driver.py"]
    assert len(found["deepest_public_class_chain"]) <= 3, found["deepest_public_class_chain"]
    assert found["hand_set_stacklevels"] == []
    assert found["backend_reads_of_private_inference_state"] == []
    assert found["modules_over_600_lines"] == {}
    # 49 after issue 29; issue 30 added FederatedNUTS, FederatedHMC and MCMCDiagnosticWarning
    # 52, print_summary, summary, SiteRoleWarning and fit; then RoundBudgetError (the bound on a fit's rounds)
    # and use_compilation_cache (the persistent compilation cache's one setting)
    assert found["public_names"] <= 58
