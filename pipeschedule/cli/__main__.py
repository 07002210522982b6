import sys

from pipeschedule.cli.main import main

sys.exit(main())
