"""The local launcher against a small hand-written member program: real subprocesses, no mocks.

The fake member reads ``behaviour`` from its task's folder and acts it out: succeed, crash, kill
itself, hang with or without heartbeats, ignore SIGTERM, exit without a result or with a
truncated one. It writes its pid (and, when it hangs, the pid of a child it spawned) so a test
can prove the launcher left no process behind. Its tasks and results are the real messages
(:mod:`pbt.protocol.messages`); what it saw of its environment it writes to ``observed.json``.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from pbt.config.errors import PbtError
from pbt.launch.local import LocalLauncher, Outcome, TaskSpec
from pbt.protocol.files import Heartbeat, read_json, write_json_atomic
from pbt.protocol.messages import RESULT_FILE, TASK_FILE, ResultMessage, TaskMessage

FAKE_MEMBER = textwrap.dedent(
    """
    import json, os, signal, subprocess, sys, time
    from pathlib import Path

    from pbt.protocol.files import Heartbeat, write_json_atomic
    from pbt.protocol.messages import ResultMessage, TaskMessage

    task_path = Path(sys.argv[-1])
    task_dir = task_path.parent
    task = TaskMessage.read(task_path)
    behaviour = (task_dir / "behaviour").read_text()
    (task_dir / "pid").write_text(str(os.getpid()))
    started = time.time()
    print(f"fake member {task.member_id} doing {behaviour}", flush=True)


    def spawn_child():
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        (task_dir / "child_pid").write_text(str(child.pid))


    def finish(sleep_s):
        with Heartbeat(task_dir / "heartbeat", interval_s=0.2):
            time.sleep(sleep_s)
        write_json_atomic(task_dir / "observed.json", {
            "argv": sys.argv[1:-1],
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "mlflow_run_id": os.environ.get("MLFLOW_RUN_ID"),
            "extra": os.environ.get("PBT_TEST_EXTRA"),
            "start": started,
            "end": time.time(),
        })
        ResultMessage(
            status="ok", member_id=task.member_id, fitness=0.0, steps=task.steps,
            checkpoint=task.checkpoint, digest="d", metrics={}, history=[],
        ).write(task_dir / "result.json")


    if behaviour == "ok":
        finish(0.2)
    elif behaviour == "slow_ok":
        finish(1.0)
    elif behaviour == "exit1":
        print("boom: the member failed", file=sys.stderr, flush=True)
        sys.exit(1)
    elif behaviour == "sigkill_self":
        os.kill(os.getpid(), signal.SIGKILL)
    elif behaviour == "hang":
        spawn_child()
        time.sleep(600)
    elif behaviour == "hang_with_heartbeat":
        spawn_child()
        with Heartbeat(task_dir / "heartbeat", interval_s=0.2):
            time.sleep(600)
    elif behaviour == "ignore_term":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        spawn_child()  # inherits SIG_IGN: only SIGKILL ends it
        time.sleep(600)
    elif behaviour == "no_result":
        with Heartbeat(task_dir / "heartbeat", interval_s=0.2):
            time.sleep(0.1)
    elif behaviour == "truncated_result":
        (task_dir / "result.json").write_text('{"status": "o')
    elif behaviour == "error_result":
        write_json_atomic(task_dir / "result.json", {"status": "error", "error": "diverged"})
    """
)

HEARTBEAT_TIMEOUT_S = 2.0
TASK_TIMEOUT_S = 4.0


@pytest.fixture(scope="module")
def fake_member(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("fake") / "fake_member.py"
    path.write_text(FAKE_MEMBER)
    return path


TASK_DIRS: dict[str, Path] = {}
"""The folder of the latest task made with each id (what :func:`seen` reads)."""


def make_task(root: Path, task_id: str, behaviour: str, **fields: object) -> TaskSpec:
    """A task for the fake members: its message (``fields`` changed), its ``behaviour``."""
    task_dir = root / task_id
    task_dir.mkdir(parents=True)
    (task_dir / "behaviour").write_text(behaviour)
    write_task(task_dir, **fields)
    TASK_DIRS[task_id] = task_dir
    return TaskSpec(task_id, task_dir, root / "logs" / f"{task_id}.attempt1.log")


def write_task(task_dir: Path, **fields: object) -> None:
    """Write the task message of the task in ``task_dir`` (named after it), ``fields`` changed."""
    task = {
        "campaign_dir": str(task_dir.parent),
        "manifest": {},
        "manifest_base_dir": str(task_dir.parent),
        "member_id": task_dir.name,
        "generation": 0,
        "parent_id": None,
        "parent_checkpoint": None,
        "parent_digest": None,
        "hyperparameters": {"lr": 1e-3},
        "mutation": None,
        "steps": 1,
        "checkpoint": f"checkpoints/{task_dir.name}",
    }
    TaskMessage(**(task | fields)).write(task_dir / TASK_FILE)  # type: ignore[arg-type]


def seen(outcome: Outcome) -> dict:
    """What the fake member of ``outcome``'s task saw (``observed.json``); {} when none."""
    return read_json(TASK_DIRS[outcome.task_id] / "observed.json") or {}


def launcher(fake: Path, slots: int, **kwargs: object) -> LocalLauncher:
    command = [sys.executable, str(fake), "--nproc={nproc}", "--port={port}"]
    options = {"heartbeat_timeout_s": HEARTBEAT_TIMEOUT_S, "poll_s": 0.05, **kwargs}
    return LocalLauncher(command, slots, **options)  # type: ignore[arg-type]


def alive(pid: int) -> bool:
    """True while ``pid`` is a live (not zombie) process."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state not in ("Z", "X")


def wait_dead(pid: int, within_s: float = 3.0) -> bool:
    """True once ``pid`` is gone (orphans are reaped by init shortly after they die)."""
    deadline = time.monotonic() + within_s
    while alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def overlaps(intervals: list[tuple[float, float]]) -> int:
    """The most intervals that are open at one instant."""
    events = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals])
    most = current = 0
    for _, step in events:
        current += step
        most = max(most, current)
    return most


# --- every outcome kind, all in one concurrent run -------------------------------------------

BEHAVIOURS = [
    "ok",
    "exit1",
    "sigkill_self",
    "hang",
    "hang_with_heartbeat",
    "ignore_term",
    "no_result",
    "truncated_result",
    "error_result",
]


@pytest.fixture(scope="module")
def every_outcome(
    fake_member: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[dict[str, Outcome], dict[str, TaskSpec], float]:
    root = tmp_path_factory.mktemp("every")
    tasks = [make_task(root, b, b) for b in BEHAVIOURS]
    started = time.monotonic()
    outcomes = launcher(fake_member, len(tasks), task_timeout_s=TASK_TIMEOUT_S).run(tasks)
    elapsed = time.monotonic() - started
    assert [o.task_id for o in outcomes] == BEHAVIOURS
    return {o.task_id: o for o in outcomes}, {t.task_id: t for t in tasks}, elapsed


def test_ok_returns_the_result(every_outcome) -> None:
    outcome = every_outcome[0]["ok"]
    assert (outcome.status, outcome.returncode) == ("ok", 0), outcome.detail
    assert outcome.result is not None and outcome.result.member_id == "ok"


def test_exit_code_names_the_code_and_shows_the_log(every_outcome) -> None:
    outcome = every_outcome[0]["exit1"]
    assert (outcome.status, outcome.returncode) == ("failed", 1)
    assert "exit code 1" in outcome.detail
    assert "boom: the member failed" in outcome.detail


def test_death_by_signal_names_the_signal(every_outcome) -> None:
    outcome = every_outcome[0]["sigkill_self"]
    assert (outcome.status, outcome.returncode) == ("failed", -signal.SIGKILL)
    assert "killed by SIGKILL" in outcome.detail


def test_silent_member_is_killed_for_no_heartbeat(every_outcome) -> None:
    outcome = every_outcome[0]["hang"]
    assert outcome.status == "no_heartbeat"
    assert outcome.returncode == -signal.SIGTERM
    assert "no heartbeat" in outcome.detail and "killed by SIGTERM" in outcome.detail
    assert HEARTBEAT_TIMEOUT_S <= outcome.seconds < TASK_TIMEOUT_S


def test_heartbeating_member_is_killed_at_task_timeout(every_outcome) -> None:
    outcome = every_outcome[0]["hang_with_heartbeat"]
    assert outcome.status == "timeout"
    assert outcome.seconds >= TASK_TIMEOUT_S
    assert "task_timeout_s" in outcome.detail


def test_member_ignoring_sigterm_is_sigkilled(every_outcome) -> None:
    outcome = every_outcome[0]["ignore_term"]
    assert outcome.status == "no_heartbeat"
    assert outcome.returncode == -signal.SIGKILL
    assert "killed by SIGKILL" in outcome.detail


def test_exit_zero_without_result_is_no_result(every_outcome) -> None:
    outcome = every_outcome[0]["no_result"]
    assert (outcome.status, outcome.returncode, outcome.result) == ("no_result", 0, None)


def test_truncated_or_unsuccessful_result_is_bad_result(every_outcome) -> None:
    truncated, error = every_outcome[0]["truncated_result"], every_outcome[0]["error_result"]
    assert (truncated.status, truncated.result) == ("bad_result", None)
    assert error.status == "bad_result"
    assert error.result is None and "status ('error') is not 'ok'" in error.detail
    assert "'error'" in error.detail


def test_killed_members_leave_no_process_behind(every_outcome) -> None:
    tasks = every_outcome[1]
    for behaviour in ("hang", "hang_with_heartbeat", "ignore_term"):
        task_dir = tasks[behaviour].task_dir
        for name in ("pid", "child_pid"):
            pid = int((task_dir / name).read_text())
            assert wait_dead(pid), f"{behaviour}: {name} {pid} is still alive"


def test_kills_run_concurrently_with_other_tasks(every_outcome) -> None:
    # Hangs, timeouts and the 5 s SIGTERM grace overlap; run back to back they would take ~13 s.
    assert every_outcome[2] < TASK_TIMEOUT_S + 5.0 + 3.0


def test_log_receives_the_member_output(every_outcome) -> None:
    tasks = every_outcome[1]
    assert "fake member ok doing ok" in tasks["ok"].log_path.read_text()
    assert "boom: the member failed" in tasks["exit1"].log_path.read_text()


# --- scheduling: slots, GPUs, ports -----------------------------------------------------------


def run_slow(fake: Path, root: Path, slots: int, **kwargs: object):
    """Run 4 slow tasks; return outcomes, (slot, start, end) per task id, and the wall time."""
    tasks = [make_task(root, f"g000-m{i:02d}", "slow_ok") for i in range(4)]
    slots_of: dict[str, int] = {}
    done: list[str] = []
    started = time.monotonic()
    outcomes = launcher(fake, slots, **kwargs).run(
        tasks,
        on_start=lambda task, slot: slots_of.setdefault(task.task_id, slot),
        on_done=lambda outcome: done.append(outcome.task_id),
    )
    elapsed = time.monotonic() - started
    assert [o.status for o in outcomes] == ["ok"] * 4, [o.detail for o in outcomes]
    assert sorted(done) == [t.task_id for t in tasks]
    return outcomes, slots_of, elapsed


def test_concurrency_is_bounded_by_slots(fake_member: Path, tmp_path: Path) -> None:
    outcomes, slots_of, elapsed = run_slow(fake_member, tmp_path, slots=2)
    intervals = [(seen(o)["start"], seen(o)["end"]) for o in outcomes]
    assert overlaps(intervals) == 2
    assert set(slots_of.values()) == {0, 1}
    single = max(end - start for start, end in intervals)
    assert 2 * single <= elapsed < 3 * single + 1.0, (elapsed, single)
    assert all(seen(o)["cuda_visible_devices"] == "" for o in outcomes)
    assert all(seen(o)["argv"][0] == "--nproc=1" for o in outcomes)


def test_gpu_groups_and_ports_are_disjoint(fake_member: Path, tmp_path: Path) -> None:
    outcomes, slots_of, _ = run_slow(
        fake_member, tmp_path, slots=2, gpus_per_member=2, gpu_ids=[0, 1, 2, 3], base_port=29700
    )
    groups = {0: "0,1", 1: "2,3"}
    for outcome in outcomes:
        assert seen(outcome)["cuda_visible_devices"] == groups[slots_of[outcome.task_id]]
    records = [(seen(o)["start"], seen(o)["end"], seen(o)) for o in outcomes]
    for i, (start_a, end_a, a) in enumerate(records):
        for start_b, end_b, b in records[i + 1 :]:
            if start_a < end_b and start_b < end_a:  # ran at the same time
                assert a["cuda_visible_devices"] != b["cuda_visible_devices"]
                assert a["argv"][1] != b["argv"][1]
    ports = {seen(o)["argv"][1] for o in outcomes}
    assert ports <= {"--port=29700", "--port=29710"}


def test_members_per_gpu_share_a_gpu_group_with_ports_of_their_own(
    fake_member: Path, tmp_path: Path
) -> None:
    """``members_per_gpu: 2``: four slots on two GPUs, two members on each at once."""
    tasks = [make_task(tmp_path, f"g000-m{i:02d}", "slow_ok") for i in range(4)]
    slots_of: dict[str, int] = {}
    run = launcher(fake_member, 4, gpus_per_member=1, gpu_ids=[5, 7], members_per_gpu=2,
                   base_port=29800)  # fmt: skip
    outcomes = run.run(tasks, on_start=lambda t, slot: slots_of.setdefault(t.task_id, slot))
    assert [o.status for o in outcomes] == ["ok"] * 4
    for outcome in outcomes:
        expected = "5" if slots_of[outcome.task_id] < 2 else "7"
        assert seen(outcome)["cuda_visible_devices"] == expected
    assert overlaps([(seen(o)["start"], seen(o)["end"]) for o in outcomes]) == 4
    assert len({seen(o)["argv"][1] for o in outcomes}) == 4  # a port each
    with pytest.raises(ValueError, match="members_per_gpu"):
        launcher(fake_member, 5, gpus_per_member=1, gpu_ids=[5, 7], members_per_gpu=2)


def test_busy_port_is_skipped(fake_member: Path, tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        task = make_task(tmp_path, "t", "ok")
        [outcome] = launcher(fake_member, 1, base_port=port).run([task])
    assert seen(outcome)["argv"][1] == f"--port={port + 1}"


def test_env_is_inherited_without_mlflow_run_id(
    fake_member: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MLFLOW_RUN_ID", "the-controller-run")
    task = make_task(tmp_path, "t", "ok")
    [outcome] = launcher(fake_member, 1, env={"PBT_TEST_EXTRA": "x"}).run([task])
    assert seen(outcome)["mlflow_run_id"] is None
    assert seen(outcome)["extra"] == "x"


# --- attempts, interruption, validation --------------------------------------------------------


def test_stale_files_of_a_previous_attempt_are_ignored(fake_member: Path, tmp_path: Path) -> None:
    task = make_task(tmp_path, "t", "no_result")
    write_stale_result(task.task_dir)
    [outcome] = launcher(fake_member, 1).run([task])
    assert outcome.status == "no_result"

    failing = make_task(tmp_path, "u", "exit1")
    (failing.task_dir / "heartbeat").touch()
    write_stale_result(failing.task_dir)
    [outcome] = launcher(fake_member, 1).run([failing])
    assert outcome.status == "failed"
    assert not (failing.task_dir / "heartbeat").exists()
    assert not (failing.task_dir / "result.json").exists()


def write_stale_result(task_dir: Path) -> None:
    """An ok result left by an earlier attempt of the task in ``task_dir``."""
    ResultMessage(
        status="ok", member_id=task_dir.name, fitness=0.0, steps=1,
        checkpoint=f"checkpoints/{task_dir.name}", digest="d", metrics={}, history=[],
    ).write(task_dir / RESULT_FILE)  # fmt: skip


def test_interrupt_kills_every_running_task(fake_member: Path, tmp_path: Path) -> None:
    tasks = [make_task(tmp_path, f"m{i}", "hang_with_heartbeat") for i in range(3)]

    def interrupt_once_all_run(task: TaskSpec, slot: int) -> None:
        if slot < 1:
            return
        deadline = time.monotonic() + 10
        while not all((t.task_dir / "child_pid").exists() for t in tasks[:2]):
            assert time.monotonic() < deadline, "fake members did not start"
            time.sleep(0.05)
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        launcher(fake_member, 2).run(tasks, on_start=interrupt_once_all_run)
    for task in tasks[:2]:
        for name in ("pid", "child_pid"):
            assert wait_dead(int((task.task_dir / name).read_text()))
    assert not (tasks[2].task_dir / "pid").exists()  # queued, never started


def test_bad_arguments_are_reported_together() -> None:
    with pytest.raises(ValueError) as err:
        LocalLauncher([], slots=0, gpus_per_member=2, gpu_ids=[0], poll_s=0, memory_limit_bytes=0)
    message = str(err.value)
    for needle in ("command is empty", "slots (0)", "poll_s (0)", "memory_limit_bytes (0)"):
        assert needle in message
    with pytest.raises(ValueError, match="gpu_ids"):
        LocalLauncher(["x"], slots=2, gpus_per_member=2, gpu_ids=[0, 1, 2])
    with pytest.raises(ValueError, match="gpu_ids"):
        LocalLauncher(["x"], slots=2, gpus_per_member=1, gpu_ids=[0, 0])


def test_missing_task_json_is_refused_before_anything_starts(tmp_path: Path) -> None:
    task = TaskSpec("t", tmp_path / "t", tmp_path / "t.log")
    with pytest.raises(PbtError, match=r"task\.json"):
        LocalLauncher(["true"], slots=1).run([task])
    assert not task.log_path.exists()


# --- member-side helpers -------------------------------------------------------------------------


def test_json_helpers_round_trip_and_reject_damage(tmp_path: Path) -> None:
    path = tmp_path / "result.json"
    assert read_json(path) is None
    write_json_atomic(path, {"status": "ok", "fitness": 0.5})
    assert read_json(path) == {"status": "ok", "fitness": 0.5}
    assert [p.name for p in tmp_path.iterdir()] == ["result.json"]  # no temp file left
    path.write_text('{"status": "ok", "fit')
    assert read_json(path) is None
    path.write_text("[1, 2]")
    assert read_json(path) is None


def test_heartbeat_keeps_touching_until_exit(tmp_path: Path) -> None:
    path = tmp_path / "heartbeat"
    with Heartbeat(path, interval_s=0.05):
        assert path.exists()
        first = path.stat().st_mtime_ns
        time.sleep(0.3)
        assert path.stat().st_mtime_ns > first
    assert not any(t.name == "pbt-heartbeat" for t in threading.enumerate())
    last = path.stat().st_mtime_ns
    time.sleep(0.15)
    assert path.stat().st_mtime_ns == last


def test_launch_imports_no_torch() -> None:
    code = "import sys, pbt.launch.local; print(sorted(m for m in sys.modules if m.startswith('torch')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# -- long-lived workers ----------------------------------------------------------------------

SERVING_MEMBER = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    from threading import Thread

    from pbt.protocol.files import Heartbeat, read_json, write_json_atomic
    from pbt.worker.serve import next_entry as _next_entry

    folder = Path(sys.argv[sys.argv.index("--serve") + 1])
    served = 0
    while True:
        entry = _next_entry(folder, served, 30.0, 0.02)
        if entry is None:
            sys.exit(0)
        served += 1
        task_path = Path(entry["task"])
        task = read_json(task_path)
        behaviour = (task_path.parent / "behaviour").read_text()
        if behaviour == "hang":
            time.sleep(600)
        began = time.time()
        with Heartbeat(task_path.parent / "heartbeat", interval_s=0.1):
            print("serving", task_path.parent.name, flush=True)
            if behaviour == "exit1":
                sys.exit(1)
            time.sleep(7.0 if behaviour == "slow" else 0.05)
            after = folder / "inbox" / f"{served:06d}.json"
            write_json_atomic(task_path.parent / "observed.json", {
                "pid": os.getpid(), "served": served, "began": began,
                "next_handed_over": after.exists()})
            named = task_path.parent / "digest"
            digest = named.read_text() if named.exists() else "d"
            result = {"status": "ok", "member_id": task["member_id"], "fitness": 0.0,
                      "steps": task["steps"], "checkpoint": task["checkpoint"],
                      "digest": digest, "metrics": {}, "history": []}
            if behaviour == "release":  # the result now, the "checkpoint" in the background
                write_json_atomic(task_path.parent / "released", {**result, "digest": None})
                done = task_path.parent / "result.json"
                Thread(target=lambda r=result, d=done, g=digest: (time.sleep(1.0),
                       write_json_atomic(d, {**r, "digest": g}))).start()
                continue
            write_json_atomic(task_path.parent / "result.json", result)
    """
)


def serving_launcher(tmp_path: Path, slots: int = 1, members_per_batch: int = 1):
    """``slots`` slots (default one) of long-lived workers running SERVING_MEMBER, handed
    ``members_per_batch`` tasks at a time."""
    from pbt.launch.persistent import PersistentLauncher

    script = tmp_path / "serving_member.py"
    script.write_text(SERVING_MEMBER)
    return PersistentLauncher(
        [sys.executable, str(script), "--nproc={nproc}", "--port={port}"],
        tmp_path / "workers",
        slots=slots,
        heartbeat_timeout_s=6.0,  # a worker's first heartbeat follows its imports
        poll_s=0.05,
        members_per_batch=members_per_batch,
    )


def test_long_lived_worker_serves_tasks_in_turn_and_is_replaced_after_a_fault(tmp_path):
    """One slot: three tasks on one worker; a task that crashes and one that hangs each take
    their worker down, and a fresh worker serves the next task; close() ends the last one."""
    workers = serving_launcher(tmp_path)
    behaviours = ["ok", "ok", "ok", "exit1", "ok", "hang", "ok"]
    tasks = [make_task(tmp_path, f"t{i}-{b}", b) for i, b in enumerate(behaviours)]
    try:
        outcomes = workers.run(tasks)
        worker = workers._workers[0].proc
    finally:
        workers.close()
    assert [o.status for o in outcomes] == [
        "ok", "ok", "ok", "failed", "ok", "no_heartbeat", "ok",
    ]  # fmt: skip
    served = [seen(o).get("pid") for o in outcomes]
    assert served[0] == served[1] == served[2]  # one worker served the first three
    assert [seen(o)["served"] for o in outcomes[:3]] == [1, 2, 3]
    assert len({served[0], served[4], served[6]}) == 3  # a fresh worker after each fault
    assert seen(outcomes[4])["served"] == 1 and seen(outcomes[6])["served"] == 1
    assert "exit code 1" in outcomes[3].detail
    assert "no heartbeat" in outcomes[5].detail
    assert wait_dead(worker.pid)


def test_workers_that_batch_get_even_shares(tmp_path):
    """Two slots whose workers take 4 tasks at a time (``launch.members_per_batch: 4``): the 8
    tasks of a call are handed 4 to each, not as many as the first slot's inbox holds."""
    workers = serving_launcher(tmp_path, slots=2, members_per_batch=4)
    tasks = [make_task(tmp_path, f"t{i}", "ok") for i in range(8)]
    try:
        outcomes = workers.run(tasks)
    finally:
        workers.close()
    assert [o.status for o in outcomes] == ["ok"] * 8
    served = [seen(o)["pid"] for o in outcomes]
    assert sorted(served.count(pid) for pid in set(served)) == [4, 4], served


def test_long_lived_worker_gets_its_next_task_ahead_with_clocks_that_wait(tmp_path):
    """A worker is handed its next task while it runs the current one, so it starts it with no
    round trip through the controller; the task handed ahead shows as queued, and its
    heartbeat clock starts only when the task before it lets go: behind a member that trains
    longer than the heartbeat timeout, it is not killed for silence."""
    workers = serving_launcher(tmp_path)
    tasks = [make_task(tmp_path, f"t{i}-{b}", b) for i, b in enumerate(["slow", "ok", "ok"])]
    polls: list[tuple[list[str], list[str]]] = []

    def on_poll(running, queued) -> None:
        polls.append(([t.task_id for t in running], [t.task_id for t in queued]))

    try:
        outcomes = workers.run(tasks, on_poll=on_poll)
    finally:
        workers.close()
    assert [o.status for o in outcomes] == ["ok", "ok", "ok"]
    assert len({seen(o)["pid"] for o in outcomes}) == 1
    assert seen(outcomes[0])["next_handed_over"]  # t1's entry was there before t0 ended
    assert not seen(outcomes[2])["next_handed_over"]
    assert (["t0-slow"], ["t1-ok", "t2-ok"]) in polls  # t1 handed over, not yet taken
    assert outcomes[1].seconds < 5.0  # its clock started when t0 ended, not at hand-over


@pytest.mark.parametrize("changed", [False, True])
def test_the_next_calls_tasks_start_while_the_last_results_are_written(tmp_path, changed):
    """Once every task is released with its result, ``on_released`` gets the results and hands
    the next call's first task to the idle worker, which starts it while the released tasks'
    writes still run. The next call keeps it (no second start) when it is given the same task;
    a task whose ``task.json`` changed meanwhile was a wrong guess: its worker is ended and the
    task runs afresh."""
    workers = serving_launcher(tmp_path)
    first = [make_task(tmp_path, f"a{i}", "release") for i in range(2)]
    second = [make_task(tmp_path, f"b{i}", "ok") for i in range(2)]
    calls = []

    def on_released(results):
        calls.append(results)
        return second[:1]

    try:
        outcomes = workers.run(first, on_released=on_released)
        returned = time.time()
        if changed:
            write_task(second[0].task_dir, steps=2)
        later = workers.run(second)
        kept = workers.kept_ahead
    finally:
        workers.close()
    assert [o.status for o in outcomes + later] == ["ok"] * 4
    (results,) = calls  # once, with every result, the released ones without a digest
    assert set(results) == {"a0", "a1"}
    assert results["a1"].digest is None and outcomes[1].result.digest == "d"
    pid = seen(outcomes[0])["pid"]
    if changed:
        assert kept == [] and seen(later[0])["pid"] != pid
        assert seen(later[0])["served"] == 1  # a fresh worker
    else:
        assert kept == ["b0"] and seen(later[0])["pid"] == pid
        assert seen(later[0])["began"] < returned  # behind the writes, before run() returned
        assert [seen(o)["served"] for o in later] == [3, 4]  # each started once


@pytest.mark.parametrize("digest", ["as written", "another"])
def test_a_child_of_a_parent_being_written_starts_on_the_worker_writing_it(tmp_path, digest):
    """A next-call task whose parent checkpoint is still being written (``parent_digest``
    null) is handed only to the worker writing that parent, which holds its state; one whose
    parent no worker is writing is not handed. The next call keeps it when its ``task.json``
    is the handed one with the digest that write gave, and runs it afresh otherwise."""
    workers = serving_launcher(tmp_path, slots=2)
    first = []
    for name in ("a0", "a1"):
        first.append(make_task(tmp_path, name, "release"))
        (first[-1].task_dir / "digest").write_text(f"d{name}")
    second = {}
    for name, parent in (("b0", "a1"), ("b1", "a0"), ("b2", "zz")):
        second[name] = make_task(tmp_path, name, "ok", parent_checkpoint=f"checkpoints/{parent}")
    try:
        outcomes = workers.run(first, on_released=lambda _: list(second.values()))
        returned = time.time()
        handed = workers.handed_ahead()
        for name, parent in (("b0", "a1"), ("b1", "a0")):  # as the committed generation names them
            written = f"d{parent}" if digest == "as written" or name == "b1" else digest
            write_task(
                second[name].task_dir,
                parent_checkpoint=f"checkpoints/{parent}",
                parent_digest=written,
            )
        later = workers.run(list(second.values()))
        kept = workers.kept_ahead
    finally:
        workers.close()
    assert [o.status for o in outcomes + later] == ["ok"] * 5
    assert handed == {"b0", "b1"}  # b2's parent is written by no worker
    pid = {o.task_id: seen(o)["pid"] for o in outcomes + later}
    assert pid["b1"] == pid["a0"] and seen(later[1])["began"] < returned
    if digest == "as written":
        assert sorted(kept) == ["b0", "b1"]
        assert pid["b0"] == pid["a1"] and seen(later[0])["began"] < returned
    else:  # b0's parent is not the state its worker wrote: a fresh start on a fresh worker
        assert kept == ["b1"]
        assert seen(later[0])["began"] > returned and seen(later[0])["served"] == 1


def test_a_worker_that_fails_before_its_task_leaves_its_traceback_in_the_tasks_log(tmp_path):
    """A long-lived worker that dies before it takes its task (torchrun's agent failing to
    bind, say) writes its traceback to its own log, which the slot's next worker replaces: the
    task's log, the one the fault names, gets its last lines."""
    from pbt.launch.persistent import PersistentLauncher

    crash = "raise OSError(98, 'Address already in use (EADDRINUSE)')"
    workers = PersistentLauncher(
        [sys.executable, "-c", crash], tmp_path / "workers", slots=1, poll_s=0.05
    )
    task = make_task(tmp_path, "t0", "ok")
    try:
        [outcome] = workers.run([task])
    finally:
        workers.close()
    assert outcome.status == "failed" and "exit code 1" in outcome.detail
    log = Path(task.log_path).read_text()
    assert "OSError: [Errno 98] Address already in use (EADDRINUSE)" in log
    assert f"last lines of {tmp_path / 'workers' / 'slot0' / 'worker.log'}" in log
