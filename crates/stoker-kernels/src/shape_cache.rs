//! The activation buffers a step over flat buffers keeps per batch shape (the GPT's and
//! the Llama's steps), so that a window mixing two micro-batch lengths allocates nothing
//! after its first step.

/// One batch shape's buffers: the rows they are for, and the bytes they hold.
pub(crate) trait StepBuffers {
    /// Rows (batch x positions) the buffers are for.
    fn rows(&self) -> usize;
    /// Bytes held, counted from the buffers themselves.
    fn bytes(&self) -> usize;
}

/// Activation buffers of the last [`ShapeCache::KEPT`] batch shapes (rows), most recent
/// last: a window mixing two micro-batch lengths reuses both.
pub(crate) struct ShapeCache<A> {
    kept: Vec<(usize, A)>,
}

impl<A: StepBuffers> ShapeCache<A> {
    /// Batch shapes kept.
    const KEPT: usize = 2;

    pub(crate) fn new() -> Self {
        ShapeCache { kept: Vec::new() }
    }

    /// The buffers for `rows` rows: kept ones if a shape matched, else `make()`'s.
    pub(crate) fn take(&mut self, rows: usize, make: impl FnOnce() -> A) -> A {
        match self.kept.iter().position(|(r, _)| *r == rows) {
            Some(i) => self.kept.remove(i).1,
            None => make(),
        }
    }

    /// Keeps `acts` as the most recent shape, dropping the oldest.
    pub(crate) fn keep(&mut self, acts: A) {
        self.kept.push((acts.rows(), acts));
        if self.kept.len() > Self::KEPT {
            self.kept.remove(0);
        }
    }

    /// Bytes of every shape's buffers kept.
    pub(crate) fn bytes(&self) -> usize {
        self.kept.iter().map(|(_, a)| a.bytes()).sum()
    }

    /// The buffers kept, oldest first (for tests).
    #[cfg(test)]
    pub(crate) fn iter(&self) -> impl Iterator<Item = &A> {
        self.kept.iter().map(|(_, a)| a)
    }
}
