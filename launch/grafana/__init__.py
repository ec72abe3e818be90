"""The Grafana dashboard of FastGen: `fastgen.json` (import it into Grafana, data source: Prometheus) and the code
that generates it (`dashboard.py`, needs grafana-foundation-sdk: `pip install -e ".[test]"`).

Importing this package does not import the SDK; `DASHBOARD_JSON` is the committed file."""

from pathlib import Path

DASHBOARD_JSON = Path(__file__).resolve().parent / "fastgen.json"
