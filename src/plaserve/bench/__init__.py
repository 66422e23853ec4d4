"""Load generation and reporting: traces (:mod:`.trace`), the async client (:mod:`.client`), TTFT SLOs
(:mod:`.slo`), and summaries, tables and plots (:mod:`.report`). ``plaserve bench`` is :mod:`.cli`."""
