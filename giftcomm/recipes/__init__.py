"""Ready-made configurations for training stacks (``giftcomm.recipes.torchtitan``)."""
