"""What `make test` and `make test-all` differ in besides the slow marker: test-all sets GRADSVC_TEST_ALL=1
and the generated and sampled tests take more cases (op_db's samples per op, schemathesis's examples)."""

from __future__ import annotations

import os

TEST_ALL = bool(os.environ.get("GRADSVC_TEST_ALL"))
