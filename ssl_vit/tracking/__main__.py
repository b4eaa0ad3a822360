"""`python -m ssl_vit.tracking replay SPOOL_DIR [--tracking-uri URI]`; see `cli`."""

import sys

from ssl_vit.tracking.cli import main

if __name__ == "__main__":
    sys.exit(main())
