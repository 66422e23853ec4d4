"""``plaserve bench``: the async load generator (:mod:`.client`) and its command (:mod:`.cli`); traces,
request records, reports and SLOs are in :mod:`plaserve.workload`. The policy study is an experiment and
lives in the checkout's ``benchmarks/policy_study``."""
