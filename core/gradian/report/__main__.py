"""``python -m gradian.report``: print report.json's JSON Schema (the published docs/report-schema.json)."""

import sys

from gradian.report.schema import json_schema_text

sys.stdout.write(json_schema_text())
