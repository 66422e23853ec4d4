"""Workloads and their results, below everything that produces or replays them: traces of requests
(:mod:`~plaserve.workload.trace`) and the per-request records and reports every run writes
(:mod:`~plaserve.workload.report`), shared by the load generator, the offline benchmarks and the
simulator."""
