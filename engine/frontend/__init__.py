"""What runs in the HTTP process: the async engine client, engine-core launchers, tokenizer,
detokenizer."""
