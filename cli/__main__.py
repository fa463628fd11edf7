from streamdiloco.cli import main

raise SystemExit(main())
