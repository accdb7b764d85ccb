import sys

from amk_client.main import main

sys.exit(main())
