import sys

from remat.cli.main import main

sys.exit(main())
