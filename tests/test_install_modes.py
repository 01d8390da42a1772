"""``vllm_ptd.kernels`` (the top-level ``kernels/`` folder) imports under every install mode:
a wheel, a PEP 660 editable install (what ``scripts/setup.sh`` makes) and a legacy
``setup.py develop`` install, whose egg-link only puts the checkout on ``sys.path``."""
from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# A fresh interpreter that sees only the given folder for vllm_ptd: the editable install's
# finder (from its .pth file) is removed first, as it would be absent in that install mode.
PROBE = r"""
import sys
sys.meta_path[:] = [f for f in sys.meta_path  # the editable finder is a class on meta_path
                    if "editable" not in (getattr(f, "__module__", "") + type(f).__module__)]
sys.path_importer_cache.clear()
sys.path.insert(0, {root!r})
for m in [m for m in sys.modules if m.startswith("vllm_ptd")]:
    del sys.modules[m]
import vllm_ptd.kernels as K
from vllm_ptd.kernels import build_tree_mask, tree_attention  # submodules too
import vllm_ptd
assert vllm_ptd.__file__.startswith({root!r}), vllm_ptd.__file__
print(K.__file__)
"""


def _probe(root: Path) -> str:
    out = subprocess.run([sys.executable, "-c", PROBE.format(root=str(root))],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip()


def test_legacy_develop_install_imports_kernels():
    # an egg-link is the checkout root on sys.path
    assert _probe(REPO) == str(REPO / "kernels" / "__init__.py")


def test_editable_install_imports_kernels():
    out = subprocess.run([sys.executable, "-c", "import vllm_ptd.kernels as K; print(K.__file__)"],
                         capture_output=True, text=True, timeout=120, cwd="/")
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == str(REPO / "kernels" / "__init__.py")


def test_wheel_imports_kernels(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(tmp_path / "dist"), str(REPO)], check=True, timeout=300,
                   capture_output=True)
    (wheel,) = (tmp_path / "dist").glob("vllm_ptd-*.whl")
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as z:
        z.extractall(site)
        assert "vllm_ptd/kernels/tree_attention.py" in z.namelist()
    assert _probe(site) == str(site / "vllm_ptd" / "kernels" / "__init__.py")
