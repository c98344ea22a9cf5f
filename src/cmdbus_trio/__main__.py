from cmdbus_trio.cli import main

raise SystemExit(main())
