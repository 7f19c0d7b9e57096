"""cute-flash under other libraries' attention calls: `transformers` (an attention implementation
for Hugging Face models) and `flash_attn` (the module names flash-attn's clients import, such
as ring-flash-attn for context parallelism). Each is opt-in: nothing here runs on import of
cute_flash."""
