"""``python -m diloco_async.learner --learner-id ID --index I --sync-url URL --store URL``."""

from diloco_async.learner.main import main

raise SystemExit(main())
