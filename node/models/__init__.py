"""models/: base models: find, prepare and pin them by sha256, the built-in recipes, loading a causal LM
with LoRA, the adapter's model card."""
