"""The precision doctor's guide (docs/precision_doctor.md) runs as written: every Python block,
top to bottom in one namespace, with the asserts it makes about the failure and its fix."""

import pathlib
import re

import pytest

GUIDE = pathlib.Path(__file__).resolve().parents[1] / "docs" / "precision_doctor.md"


def test_the_guide_shows_the_failure_the_report_and_the_fix():
    text = GUIDE.read_text()
    assert "mpjax.diagnose" in text and "--diagnose-every" in text


@pytest.mark.slow
def test_the_guides_code_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # where the guide saves its figures
    namespace: dict = {}
    for block in re.findall(r"```python\n(.*?)```", GUIDE.read_text(), re.S):
        exec(compile(block, str(GUIDE), "exec"), namespace)  # noqa: S102
    assert namespace["again"].birth is None
    assert (tmp_path / "norm_ranges.png").stat().st_size > 0
    assert (tmp_path / "gradient_ranges.png").stat().st_size > 0
