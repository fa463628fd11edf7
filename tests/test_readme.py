"""The README's library example runs as written, against a real shard process."""

import re
from pathlib import Path

from procs import shard_process


def test_readme_python_example_runs(capsys, tmp_path):
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks, "README has no python example"
    # the shard the README starts "in another terminal", with the same flags
    start = re.search(r"streamdiloco server (--model nano .*?--port 7070)", text).group(1)
    flags = start.replace("--port 7070", "").split()
    with shard_process(tmp_path, *flags) as (target, _, _):
        for code in blocks:
            exec(compile(code.replace("127.0.0.1:7070", target), "README.md", "exec"), {})
    out = capsys.readouterr().out
    m = re.search(r"sent (\d+) bytes in (\d+) pushes", out)
    # 3 fragments, each every 30 of 90 steps, and the final sync of the two not sent at step 90
    assert m and int(m.group(2)) == 9 + 2
