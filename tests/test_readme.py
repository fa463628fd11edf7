"""The README's library example runs as written."""

import re
from pathlib import Path


def test_readme_python_example_runs(capsys):
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks, "README has no python example"
    for code in blocks:
        exec(compile(code, "README.md", "exec"), {})
    out = capsys.readouterr().out
    m = re.search(r"sent (\d+) bytes in (\d+) pushes", out)
    assert m and int(m.group(2)) == 9  # 3 fragments, each every 30 of 90 steps
