"""The sandbox holds: every misbehaving tool becomes an outcome within its deadline, nothing escapes."""

import os
import time
from pathlib import Path

import pytest

from mmpo.tools.sandbox import SandboxLimits, ToolSandbox

TOOLS = str(Path(__file__).with_name("misbehaving_tools.py"))


def spec(name: str) -> str:
    return f"{TOOLS}:{name}"


@pytest.fixture(scope="module")
def sandbox():
    box = ToolSandbox(SandboxLimits(timeout_s=2.0, cpu_time_s=2, memory_mb=512, max_output_chars=1000))
    yield box
    box.shutdown()


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except FileNotFoundError:
        return True
    return state in ("Z", "X")


def test_hanging_tool_times_out_and_the_next_call_works(sandbox):
    started = time.monotonic()
    hung, fine = sandbox.run([(spec("hang"), {"seconds": 600}), (spec("add"), {"a": 2, "b": 3})])
    assert hung.status == "timeout" and "2.0 s" in hung.text
    assert fine.status == "ok" and fine.text == "5"
    assert time.monotonic() - started < 10
    assert sandbox.run([(spec("add"), {"a": 1, "b": 1})])[0].text == "2"


def test_forking_is_refused_by_default(sandbox):
    outcome, = sandbox.run([(spec("fork_sleeper"), {})])
    assert outcome.status == "error" and "starting processes is not allowed" in outcome.text


def test_forked_children_are_killed_and_reaped_when_allowed():
    box = ToolSandbox(SandboxLimits(timeout_s=2.0, allow_subprocess=True))
    try:
        outcome, = box.run([(spec("fork_sleeper"), {})])
        assert outcome.status == "ok"
        grandchild = int(outcome.text)
        deadline = time.monotonic() + 5
        while not _gone(grandchild) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _gone(grandchild)
    finally:
        box.shutdown()


def test_unbounded_allocation_is_an_error(sandbox):
    outcome, = sandbox.run([(spec("allocate_forever"), {})])
    assert outcome.status == "error" and "MemoryError" in outcome.text


def test_writing_outside_the_directory_is_refused(sandbox, tmp_path):
    target = tmp_path / "escaped.txt"
    outside, inside = sandbox.run([(spec("write_outside"), {"path": str(target)}), (spec("write_inside"), {})])
    assert outside.status == "error" and "outside the tool's directory" in outside.text
    assert not target.exists()
    assert inside.status == "ok" and Path(inside.text).name.startswith("mmpo_tool_")
    assert not Path(inside.text).exists()  # the private directory is removed after the call


def test_megabytes_printed_or_returned(sandbox):
    printed, returned = sandbox.run([(spec("print_megabytes"), {}), (spec("huge_result"), {})])
    assert printed.status == "ok" and printed.text == "printed"  # stdout is /dev/null
    assert returned.status == "error" and "output too large" in returned.text and str(2**20) in returned.text


def test_raising_tool_and_network(sandbox):
    raised, network = sandbox.run([(spec("explode"), {"message": "boom"}), (spec("open_socket"), {})])
    assert raised.status == "error" and raised.text == "RuntimeError: boom"
    assert network.status == "error" and "network access is not allowed" in network.text


def test_python_tool_limits(sandbox, tmp_path):
    target = tmp_path / "py_escape.txt"
    outcomes = sandbox.run([
        ("python", {"code": "print(sum(range(10)))\n6 * 7"}),
        ("python", {"code": "import os"}),
        ("python", {"code": f"open({str(target)!r}, 'w').write('x')"}),
        ("python", {"code": "open('../escape.txt', 'w')"}),
        ("python", {"code": "().__class__.__bases__"}),
        ("python", {"code": "while True:\n    pass"}),
        ("python", {"code": "print('z' * 10**7)"}),
        ("python", {"code": "open('ok.txt', 'w').write('hi')\nprint(open('ok.txt').read())"}),
    ])
    assert [o.status for o in outcomes] == ["ok", "error", "error", "error", "error", "timeout", "error", "ok"]
    assert outcomes[0].text == "45\n42"
    assert "import of 'os' is not allowed" in outcomes[1].text
    assert "only files inside the working directory" in outcomes[2].text and not target.exists()
    assert "names starting with '_'" in outcomes[4].text
    assert "printed more than" in outcomes[6].text
    assert outcomes[7].text == "hi\n"


def test_unloadable_tool_is_an_error(sandbox):
    outcome, = sandbox.run([(spec("no_such_function"), {})])
    assert outcome.status == "error" and "cannot be loaded" in outcome.text
