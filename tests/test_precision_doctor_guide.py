"""The precision doctor's guide (docs/precision_doctor.md) runs as written: every Python block
as the page presents it (each chain of blocks that continue one another, tests/doc_blocks.py, in
a fresh namespace; the guide is one walk-through, so one chain), with the asserts it makes about
the failure and its fix."""

import pathlib

import pytest
from doc_blocks import chains, python_blocks

GUIDE = pathlib.Path(__file__).resolve().parents[1] / "docs" / "precision_doctor.md"


def test_the_guide_shows_the_failure_the_report_and_the_fix():
    text = GUIDE.read_text()
    assert "mpjax.diagnose" in text and "--diagnose-every" in text


@pytest.mark.slow
def test_the_guides_code_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # where the guide saves its figures
    namespaces = []
    for chain in chains(python_blocks(GUIDE.read_text(), "docs/precision_doctor.md")):
        namespace: dict = {}
        for block in chain:
            exec(compile(block.source(), str(GUIDE), "exec"), namespace)  # noqa: S102
        namespaces.append(namespace)
    (namespace,) = [ns for ns in namespaces if "again" in ns]  # the chain of the fix
    assert namespace["again"].birth is None
    assert (tmp_path / "norm_ranges.png").stat().st_size > 0
    assert (tmp_path / "gradient_ranges.png").stat().st_size > 0
