//! Addresses, page sizes and ranges.
//!
//! Three address spaces meet in a VMM and mixing them up is the classic bug, so each has its own
//! type: [`Gpa`] (guest physical, what the guest's page tables point at), [`Iova`] (I/O virtual,
//! what a device puts on the bus) and [`Hva`] (host virtual, a pointer in this process). They
//! are plain `u64` newtypes with no arithmetic that could wrap silently.
//!
//! A [`Range`] is a start and a non-zero length whose last byte fits in 64 bits. Its end is kept
//! inclusive (`last`), because a range that ends exactly at the top of the address space — legal
//! for an IOVA — has an exclusive end of 2^64, which no `u64` holds. Building a range that would
//! wrap is an error, never a silent wrap.

use std::fmt;

use crate::error::{Error, Result};

/// Something that is a 64-bit address in one of the address spaces.
pub trait Address: Copy + Ord + fmt::Debug {
    /// Name of the address space, for messages ("gpa", "iova", "hva").
    const SPACE: &'static str;
    /// The address as a number.
    fn raw(self) -> u64;
    /// A number as an address of this space.
    fn from_raw(raw: u64) -> Self;
}

macro_rules! address_type {
    ($(#[$doc:meta])* $name:ident, $space:literal) => {
        $(#[$doc])*
        #[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
        #[repr(transparent)]
        pub struct $name(pub u64);

        impl $name {
            /// The address as a number.
            #[inline]
            pub const fn raw(self) -> u64 {
                self.0
            }

            /// `self + offset`, or `None` if that passes 2^64 - 1.
            #[inline]
            pub const fn checked_add(self, offset: u64) -> Option<Self> {
                match self.0.checked_add(offset) {
                    Some(v) => Some(Self(v)),
                    None => None,
                }
            }

            /// Whether the address is a multiple of `page`.
            #[inline]
            pub const fn is_aligned(self, page: PageSize) -> bool {
                self.0 & (page.bytes() - 1) == 0
            }

            /// The start of the page that holds this address.
            #[inline]
            pub const fn align_down(self, page: PageSize) -> Self {
                Self(self.0 & !(page.bytes() - 1))
            }
        }

        impl Address for $name {
            const SPACE: &'static str = $space;
            #[inline]
            fn raw(self) -> u64 {
                self.0
            }
            #[inline]
            fn from_raw(raw: u64) -> Self {
                Self(raw)
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, concat!($space, ":{:#x}"), self.0)
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "{:#x}", self.0)
            }
        }
    };
}

address_type!(
    /// A guest physical address.
    Gpa,
    "gpa"
);
address_type!(
    /// An I/O virtual address: what a device uses for DMA.
    Iova,
    "iova"
);
address_type!(
    /// A host virtual address in this process.
    Hva,
    "hva"
);

impl Hva {
    /// The address as a pointer.
    #[inline]
    pub fn as_ptr(self) -> *mut u8 {
        self.0 as usize as *mut u8
    }

    /// A pointer as an address.
    #[inline]
    pub fn from_ptr<T>(ptr: *const T) -> Self {
        Hva(ptr as usize as u64)
    }
}

/// The base page size in bytes, [`PageSize::Size4K`]: the unit of pins, page-table words,
/// dirty bitmaps and page numbers (`addr >> 12`) throughout memvisor.
pub const PAGE_4K: u64 = PageSize::Size4K.bytes();

/// The page sizes of x86-64 and arm64 (4 KiB granule) Linux.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug)]
pub enum PageSize {
    /// 4 KiB base page.
    Size4K,
    /// 2 MiB huge page (PMD).
    Size2M,
    /// 1 GiB huge page (PUD).
    Size1G,
}

impl PageSize {
    /// Size in bytes.
    #[inline]
    pub const fn bytes(self) -> u64 {
        1 << self.shift()
    }

    /// log2 of the size.
    #[inline]
    pub const fn shift(self) -> u32 {
        match self {
            PageSize::Size4K => 12,
            PageSize::Size2M => 21,
            PageSize::Size1G => 30,
        }
    }

    /// The page size of exactly `bytes` bytes, if there is one.
    pub const fn from_bytes(bytes: u64) -> Option<Self> {
        match bytes {
            0x1000 => Some(PageSize::Size4K),
            0x20_0000 => Some(PageSize::Size2M),
            0x4000_0000 => Some(PageSize::Size1G),
            _ => None,
        }
    }

    /// Whether `value` is a multiple of this page size.
    #[inline]
    pub const fn divides(self, value: u64) -> bool {
        value & (self.bytes() - 1) == 0
    }

    /// `value` rounded up to a multiple of this page size, or `None` if that passes 2^64 - 1.
    pub const fn round_up(self, value: u64) -> Option<u64> {
        match value.checked_add(self.bytes() - 1) {
            Some(v) => Some(v & !(self.bytes() - 1)),
            None => None,
        }
    }

    /// `Ok(())` if `value` is a multiple of this page size, a [`Error::Misaligned`] naming
    /// `what` otherwise.
    pub fn check(self, what: &'static str, value: u64) -> Result<()> {
        if self.divides(value) {
            Ok(())
        } else {
            Err(Error::Misaligned {
                what,
                value,
                align: self.bytes(),
            })
        }
    }
}

impl fmt::Display for PageSize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            PageSize::Size4K => "4 KiB",
            PageSize::Size2M => "2 MiB",
            PageSize::Size1G => "1 GiB",
        })
    }
}

/// A non-empty range of addresses whose last byte fits in 64 bits.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Range<A> {
    start: A,
    len: u64,
}

impl<A: Address> Range<A> {
    /// The range `[start, start + len)`; `what` names it in the error.
    ///
    /// Fails with EINVAL if `len` is 0 or the last byte would pass 2^64 - 1.
    pub fn new(what: &'static str, start: A, len: u64) -> Result<Self> {
        if len == 0 {
            return Err(Error::ZeroSize { what });
        }
        if start.raw().checked_add(len - 1).is_none() {
            return Err(Error::RangeWraps {
                what,
                start: start.raw(),
                len,
            });
        }
        Ok(Range { start, len })
    }

    /// First address.
    #[inline]
    pub fn start(&self) -> A {
        self.start
    }

    /// Length in bytes (never 0).
    #[inline]
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Always false: ranges are never empty. Present for API symmetry with collections.
    #[inline]
    pub fn is_empty(&self) -> bool {
        false
    }

    /// Last address (inclusive); always representable.
    #[inline]
    pub fn last(&self) -> A {
        A::from_raw(self.start.raw() + (self.len - 1))
    }

    /// One past the last address, or `None` when the range ends at the top of the space.
    #[inline]
    pub fn end(&self) -> Option<A> {
        self.start.raw().checked_add(self.len).map(A::from_raw)
    }

    /// Whether `addr` lies in the range.
    #[inline]
    pub fn contains(&self, addr: A) -> bool {
        addr >= self.start && addr <= self.last()
    }

    /// Whether the two ranges share at least one address.
    #[inline]
    pub fn overlaps(&self, other: &Range<A>) -> bool {
        self.start <= other.last() && other.start <= self.last()
    }

    /// Whether `other` lies entirely inside this range.
    #[inline]
    pub fn covers(&self, other: &Range<A>) -> bool {
        other.start >= self.start && other.last() <= self.last()
    }

    /// `Ok(())` if start and length are multiples of `page`.
    pub fn check_aligned(&self, what: &'static str, page: PageSize) -> Result<()> {
        page.check(what, self.start.raw())?;
        page.check(what, self.len)
    }
}

impl<A: Address> fmt::Debug for Range<A> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}:[{:#x}, {:#x}]",
            A::SPACE,
            self.start.raw(),
            self.last().raw()
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zero_length_is_einval() {
        let e = Range::new("test", Gpa(0x1000), 0).unwrap_err();
        assert_eq!(e.errno(), libc::EINVAL);
        assert!(e.to_string().contains("size is 0"));
    }

    #[test]
    fn range_may_end_exactly_at_the_top() {
        let r = Range::new("top", Iova(u64::MAX - 0xfff), 0x1000).unwrap();
        assert_eq!(r.last(), Iova(u64::MAX));
        assert_eq!(r.end(), None);
        assert!(r.contains(Iova(u64::MAX)));
        let whole = Range::new("all", Iova(0), u64::MAX).unwrap();
        assert_eq!(whole.last(), Iova(u64::MAX - 1));
    }

    #[test]
    fn range_past_the_top_is_einval_naming_the_values() {
        let e = Range::new("dma", Iova(u64::MAX - 0xfff), 0x2000).unwrap_err();
        assert_eq!(e.errno(), libc::EINVAL);
        let msg = e.to_string();
        assert!(
            msg.contains("0xfffffffffffff000") && msg.contains("0x2000"),
            "{msg}"
        );
        assert!(Range::new("x", Gpa(2), u64::MAX).is_err());
        assert!(Range::new("x", Gpa(1), u64::MAX).is_ok());
        assert!(Range::new("x", Gpa(0), u64::MAX).is_ok());
    }

    #[test]
    fn overlap_and_cover() {
        let a = Range::new("a", Gpa(0x1000), 0x2000).unwrap();
        let b = Range::new("b", Gpa(0x2fff), 1).unwrap();
        let c = Range::new("c", Gpa(0x3000), 1).unwrap();
        assert!(a.overlaps(&b) && b.overlaps(&a));
        assert!(!a.overlaps(&c) && !c.overlaps(&a));
        assert!(a.covers(&b) && !a.covers(&c));
    }

    #[test]
    fn page_sizes() {
        for p in [PageSize::Size4K, PageSize::Size2M, PageSize::Size1G] {
            assert_eq!(PageSize::from_bytes(p.bytes()), Some(p));
            assert!(p.divides(p.bytes() * 3));
            assert!(!p.divides(p.bytes() + 0x800));
            assert_eq!(p.round_up(1), Some(p.bytes()));
        }
        assert_eq!(PageSize::from_bytes(0x3000), None);
        assert_eq!(PageSize::Size4K.round_up(u64::MAX), None);
        let e = PageSize::Size2M.check("offset", 0x1000).unwrap_err();
        assert_eq!(e.errno(), libc::EINVAL);
        assert!(e.to_string().contains("offset 0x1000"));
    }

    #[test]
    fn alignment_helpers() {
        assert!(Gpa(0x20_0000).is_aligned(PageSize::Size2M));
        assert_eq!(Gpa(0x20_1234).align_down(PageSize::Size4K), Gpa(0x20_1000));
        assert_eq!(Gpa(u64::MAX).checked_add(1), None);
        assert_eq!(format!("{:?}", Iova(0x10)), "iova:0x10");
    }
}
