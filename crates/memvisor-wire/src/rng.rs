//! The random source of the hostile clients (memvisor-testkit's `vhost-user-fuzz`, `vfio-user-fuzz`): a xorshift
//! generator, so that one seed always sends the same messages (a failure found by a seed can be
//! sent again), with draws that favour the values parsers get wrong — zero, the top of 64 bits,
//! powers of two, page multiples and a byte past them.

/// A seeded xorshift64 generator.
pub struct Rng(u64);

impl Rng {
    /// A generator for `seed` (any value; zero is made odd, as xorshift needs).
    pub fn new(seed: u64) -> Rng {
        Rng(seed | 1)
    }

    /// The next 64 random bits.
    pub fn bits(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }

    /// A number below `n` (0 for `n` 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.bits() % n.max(1)
    }

    /// True `percent` times in 100.
    pub fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }

    /// A value that is often at an edge: 0, `u64::MAX` or just below, a power of two, a
    /// multiple of 4 KiB, a small number, a multiple of 4 KiB plus an odd part; else any.
    pub fn edgy(&mut self) -> u64 {
        match self.below(9) {
            0 => 0,
            1 => u64::MAX,
            2 => u64::MAX - self.below(0x10000),
            3 => 1 << self.below(64),
            4 => (1 << 12) * self.below(8192),
            5 => self.below(1 << 16),
            6 => (1 << 12) * self.below(8192) + 1 + self.below(4095),
            _ => self.bits(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Rng;

    #[test]
    fn one_seed_one_sequence_and_draws_in_range() {
        let a: Vec<u64> = (0..8).scan(Rng::new(7), |r, _| Some(r.bits())).collect();
        let b: Vec<u64> = (0..8).scan(Rng::new(7), |r, _| Some(r.bits())).collect();
        assert_eq!(a, b);
        assert_ne!(
            a,
            (0..8)
                .scan(Rng::new(8), |r, _| Some(r.bits()))
                .collect::<Vec<_>>()
        );
        let mut r = Rng::new(0);
        assert!((0..1000).all(|_| r.below(10) < 10));
        assert_eq!(r.below(0), 0);
        let edges = (0..2000)
            .map(|_| r.edgy())
            .filter(|&v| v == 0 || v == u64::MAX)
            .count();
        assert!(edges > 200, "{edges} edge values in 2000 draws");
    }
}
