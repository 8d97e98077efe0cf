"""Resident memory of a `specloom serve` process after each of N chunked uploads past its 16 MiB body limit (each
refused with 413), to see whether the refusals leave the server's RSS higher for good (the soak's flat-RSS
check failed in CI on such a step).

    python scripts/chunked_refusal_rss.py [MODEL] [N]      # default smollm2-135m, 24
"""
import os
import sys
import time

from specloom.bench.soak import ServeProcess
from specloom.bench.soak_requests import _oversized

model = sys.argv[1] if len(sys.argv) > 1 else "smollm2-135m"
n = int(sys.argv[2]) if len(sys.argv) > 2 else 24
srv = ServeProcess(model, ["--max-model-len", "512"], "/tmp/chunked_refusal_rss.log",
                   {**os.environ, "OMP_NUM_THREADS": "1"})
try:
    print(f"start: RSS {srv.rss_kib() / 1024:.1f} MiB")
    for i in range(n):
        status, _ = _oversized(srv.port, "chunked_past_limit", 60.0)
        time.sleep(0.3)
        print(f"refusal {i + 1:2d}: status {status}, RSS {srv.rss_kib() / 1024:.1f} MiB")
finally:
    srv.stop()
