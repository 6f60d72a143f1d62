"""The processes of a run on one machine and what they need from the OS (DESIGN §3, §5).

:mod:`~diloco_async.runtime.procs` starts, signals and stops processes;
:mod:`~diloco_async.runtime.supervisor` restarts the learners that die;
:mod:`~diloco_async.runtime.parent_death` makes a child die with its parent;
:mod:`~diloco_async.runtime.process_clock` says how long a process has existed;
:mod:`~diloco_async.runtime.priority` lowers a background thread's priority;
:mod:`~diloco_async.runtime.heap` tunes the C heap's retention;
:mod:`~diloco_async.runtime.devices` picks a rank's device and precision;
:mod:`~diloco_async.runtime.link_delay` adds a region's one-way latency (the WAN harness);
:mod:`~diloco_async.runtime.hub` downloads from the Hugging Face Hub in one child process and finds the copies offline.
"""
