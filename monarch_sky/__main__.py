from monarch_sky.cli import main

raise SystemExit(main())
