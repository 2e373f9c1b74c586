//! The activation buffers a step over flat buffers keeps per batch shape (the GPT's and
//! the Llama's steps), so that a window mixing two micro-batch lengths allocates nothing
//! after its first step.

/// Activation buffers of the last [`ShapeCache::KEPT`] batch shapes (rows), most recent
/// last: a window mixing two micro-batch lengths reuses both.
pub(crate) struct ShapeCache<A> {
    kept: Vec<(usize, A)>,
}

impl<A> ShapeCache<A> {
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

    /// Keeps `acts` (for `rows` rows) as the most recent shape, dropping the oldest.
    pub(crate) fn keep(&mut self, rows: usize, acts: A) {
        self.kept.push((rows, acts));
        if self.kept.len() > Self::KEPT {
            self.kept.remove(0);
        }
    }

    /// The buffers kept, oldest first.
    pub(crate) fn iter(&self) -> impl Iterator<Item = &A> {
        self.kept.iter().map(|(_, a)| a)
    }
}
