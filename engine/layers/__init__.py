"""Model building blocks: norms, rotary embedding, activations, linear layers."""
