from batchtune.cli import main

raise SystemExit(main())
