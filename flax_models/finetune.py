"""``python -m flax_models.finetune MODEL --data FILE --output DIR ...``: the supervised
fine-tuning CLI (``flax_models.training.finetune``)."""

import sys

from flax_models.training.finetune import main

if __name__ == "__main__":
    sys.exit(main())
