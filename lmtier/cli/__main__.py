import sys

from lmtier.cli.parser import main

sys.exit(main())
