import sys

from specedge.cli import main

sys.exit(main())
