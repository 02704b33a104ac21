"""Images, videos and audio in prompts: where rows keep them (`refs`), decoding within limits
(`load`), the preprocessed-media store (`cache`) and the one call that processes a prompt
(`prepare`)."""
