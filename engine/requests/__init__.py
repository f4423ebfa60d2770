"""What a request is and carries inside the engine: its state (`Request`), its parameters
(`SamplingParams`, the checkpoint's defaults), its outputs, and how its tokens become text and
when it stops."""
