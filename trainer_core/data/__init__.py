"""A job's rows from upload to batch: the row formats and upload check, media archives, the tokenized and
decoded stores, chat rendering, and the sampler, collator and packing. `rows` imports no torch."""
