"""Compare the step policies (pla, fcfs, spf) on one instance, replaying real trace slices.

    .venv/bin/python benchmarks/policies.py --out docs/img  # full run (~10 min), tables + plots
    .venv/bin/python benchmarks/policies.py --quick        # ~2 min (what `plaserve demo` runs)

Setup, fixed before looking at results:
* the embedded default model (random weights, float32, CPU), one engine per policy, same settings;
* lengths of the Azure traces scaled by --length-scale (0.25; prompts capped at 4000, outputs at 64);
  arrivals rescaled so the predicted prefill work fills --load of the arrival window (code 0.68,
  conversation 0.31: its long outputs add much decode work; the decode work comes on top, and the
  measured utilization of each policy is printed: the loads aim fcfs at about 75 %);
* TTFT SLO of each request = max(floor, 5 x its predicted isolated prefill time), the cost model being
  fitted on this machine at the start of the run;
* short = fewer than 512 uncached prompt tokens.
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

from policy_study.policies import main  # noqa: E402

if __name__ == "__main__":
    t0 = time.time()
    code = main(sys.argv[1:])
    print(f"\n(total {time.time() - t0:.0f} s)")
    sys.exit(code)
