"""``python -m diloco_async.learner --learner-id ID --index I --sync-url URL --store URL``."""

from diloco_async.learner.main import main

if __name__ == "__main__":
    raise SystemExit(main())
