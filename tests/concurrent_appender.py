"""One OS process writing receipts (each with its audit leaf, one transaction each) as a gateway
process does; started several times at once by tests/test_audit_concurrency.py.

    python tests/concurrent_appender.py URL NAME READY_DIR COUNT TENANT [TENANT ...]

Connects, says it is ready (a file READY_DIR/NAME), waits for READY_DIR/go, then writes COUNT
receipts, cycling through the tenants, and prints each one's (tenant, receipt id) as JSON.
"""

import json
import sys
import time
from pathlib import Path

from provenance.db import get_engine, session_scope
from provenance.receipts import ReceiptRecord, write_receipts


def record(name: str, tenant: str, i: int) -> ReceiptRecord:
    return ReceiptRecord(
        receipt_id=f"rcpt_{name}_{i:05d}",
        tenant_id=tenant,
        api_key_id=None,
        model_id="m",
        weights_hash="w" * 64,
        messages=[{"role": "user", "content": f"question {i} from {name}"}],
        sampling={"temperature": 0, "max_tokens": 4},
        engine={},
        retrieval=None,
        prompt_text=f"question {i}",
        prompt_token_count=3,
        template_version="t",
        output_text=f"answer {i}",
    )


def main() -> None:
    url, name, ready_dir, count, *tenants = sys.argv[1:]
    with get_engine(url).connect():  # connected before the start line
        pass
    ready = Path(ready_dir)
    (ready / name).touch()
    while not (ready / "go").exists():
        time.sleep(0.005)
    for i in range(int(count)):
        tenant = tenants[i % len(tenants)]
        with session_scope(url, write=True) as session:
            write_receipts(session, [record(name, tenant, i)])
        print(json.dumps([tenant, f"rcpt_{name}_{i:05d}"]), flush=True)


if __name__ == "__main__":
    main()
