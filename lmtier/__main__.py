import sys

from lmtier.cli import main

sys.exit(main())
