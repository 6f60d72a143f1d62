"""Memory near the model's size (issue 17 item 3): streamed state files, a copy-free inner-state
capture, one inner-state checkpoint in the store, and kept versions read back from the store."""





def test_memory_benchmark_quick_measures_real_processes():
    from benchmarks.memory import bars
    rows = bars(quick=True)
    assert [b.figure.split(",")[0] for b in rows] == ["learner RSS beyond baseline / model fp32",
                                                      "synchronizer RSS beyond baseline / model fp32"]
    assert all(b.value is not None and b.value > 0 for b in rows), rows  # both processes were sampled
