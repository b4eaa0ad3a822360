import sys

from ssl_vit import startup
from ssl_vit.tracking.cli import main

if __name__ == "__main__":
    startup.begin(pause_gc=False)  # MLflow telemetry off by default (ssl_vit/startup.py)
    sys.exit(main())
