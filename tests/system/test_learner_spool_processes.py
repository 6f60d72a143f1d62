"""The learner's spool in real learner processes: spool folders of killed learners are removed by the
next one, and the learner process sets its switch interval, threads and heap before anything runs."""

import os


def test_spool_folders_of_killed_learners_are_removed_by_the_next_one(tmp_path):
    """A SIGKILLed learner leaves its spool folder (up to 5x the model); the next process of that
    learner removes it, and leaves alone a live process's folder and another learner's."""
    import signal
    import subprocess
    import sys

    from diloco_async.learner.spool import new_spool_folder, remove_dead_spool_folders

    code = ("import sys, time; from diloco_async.learner.spool import new_spool_folder; "
            "d = new_spool_folder('learner-3', sys.argv[1]); "
            "open(d + '/state-1.safetensors', 'wb').write(b'x' * 4096); "
            "print(d, flush=True); time.sleep(60)")
    child = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    dead = child.stdout.readline().strip()
    child.send_signal(signal.SIGKILL)
    child.wait(timeout=30)
    child.stdout.close()
    mine = new_spool_folder("learner-3", str(tmp_path))  # this process: alive
    other = tmp_path / f"diloco-learner-4-pid{child.pid}-state-abc"  # another learner's, same dead pid
    other.mkdir()
    assert remove_dead_spool_folders("learner-3", str(tmp_path)) == [dead]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([other.name, mine.rsplit("/", 1)[1]])


def test_the_learner_process_sets_its_switch_interval_threads_and_heap_before_anything_runs():
    """A learner's background threads hand the GIL back within 0.5 ms, not CPython's 5 ms (issue 17):
    ``main`` applies it even when it then refuses to start (no token), as in every learner and rank."""
    import subprocess
    import sys

    from diloco_async.learner.main import LEARNER_SWITCH_INTERVAL_S
    from diloco_async.protocol.client import LEARNER_TOKEN_ENV

    code = ("import sys, torch; from diloco_async.learner.main import main; "
            "rc = main(['--learner-id', 'l0', '--index', '0', '--sync-url', 'http://127.0.0.1:9', "
            "'--store', 'memory://x']); print(rc, sys.getswitchinterval(), torch.get_num_threads())")
    env = {k: v for k, v in os.environ.items() if k != LEARNER_TOKEN_ENV}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    rc, interval, threads = out.stdout.split()
    assert (rc, float(interval), threads) == ("2", LEARNER_SWITCH_INTERVAL_S, "1"), out.stderr[-2000:]
    assert LEARNER_SWITCH_INTERVAL_S < 0.005
