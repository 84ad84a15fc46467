//! Large host buffers for collectives.

/// A vector of `len` copies of `value` whose pages the kernel is asked to back with transparent
/// huge pages, and which are all touched before it is returned.
///
/// Large collective buffers are streamed through the kernel's socket copies; with 4 KiB pages
/// every 4 KiB costs a TLB miss on each copy. Huge pages are only advice: where the kernel
/// declines, this is an ordinary vector.
pub(crate) fn huge_filled<T: bytemuck::Pod>(len: usize, value: T) -> Vec<T> {
    const HUGE: usize = 2 << 20;
    let mut v: Vec<T> = Vec::with_capacity(len);
    let spare = v.spare_capacity_mut();
    let bytes = std::mem::size_of_val(spare);
    let ptr = spare.as_mut_ptr() as usize;
    let start = ptr.next_multiple_of(HUGE);
    let end = (ptr + bytes) / HUGE * HUGE;
    if end > start {
        // SAFETY: [start, end) lies inside this vector's allocation, which nothing else references
        // yet, and is aligned to huge pages.
        let advised = unsafe { crate::sys::advise_huge_pages(start as *mut u8, end - start) };
        if let Err(e) = advised {
            tracing::trace!("huge pages not available for a {bytes}-byte buffer: {e}");
        }
    }
    v.resize(len, value);
    v
}

#[cfg(test)]
mod tests {
    #[test]
    fn filled_with_the_value() {
        let v = super::huge_filled(5 << 20, 7u8);
        assert_eq!(v.len(), 5 << 20);
        assert!(v.iter().all(|x| *x == 7));
        assert!(super::huge_filled::<f32>(0, 1.0).is_empty());
    }
}
