//! Seeded random numbers: codebook training, sampling, synthetic weights and test inputs
//! all draw from the same small generator, so a seed reproduces any of them.

/// SplitMix64: a small, well-mixed generator.
pub struct Rng(pub(crate) u64);

impl Rng {
    /// A generator that depends on `seed` alone.
    pub fn seeded(seed: u64) -> Rng {
        Rng(seed)
    }

    /// Next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    pub fn uniform(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }

    /// Standard normal (Box–Muller).
    pub fn normal(&mut self) -> f32 {
        let u1 = self.uniform().max(1e-7);
        let u2 = self.uniform();
        (-2.0 * u1.ln()).sqrt() * (2.0 * std::f32::consts::PI * u2).cos()
    }
}

/// The Philox4x32-10 counter-based generator (Salmon et al., "Parallel random numbers:
/// as easy as 1, 2, 3", 2011): the four words that `counter` maps to under `key`. Any
/// draw is a pure function of its key and counter, so a sampler on the CPU and one on a
/// GPU give the same numbers for the same seed and position, in any order.
pub fn philox4x32(counter: [u32; 4], key: [u32; 2]) -> [u32; 4] {
    const M0: u64 = 0xD251_1F53;
    const M1: u64 = 0xCD9E_8D57;
    const W0: u32 = 0x9E37_79B9;
    const W1: u32 = 0xBB67_AE85;
    let (mut c, mut k) = (counter, key);
    for round in 0..10 {
        if round > 0 {
            k = [k[0].wrapping_add(W0), k[1].wrapping_add(W1)];
        }
        let p0 = M0 * c[0] as u64;
        let p1 = M1 * c[2] as u64;
        c = [
            ((p1 >> 32) as u32) ^ c[1] ^ k[0],
            p1 as u32,
            ((p0 >> 32) as u32) ^ c[3] ^ k[1],
            p0 as u32,
        ];
    }
    c
}

/// A uniform draw in [0, 1) with 24 bits, for `seed` at `index`: the first word of
/// [`philox4x32`] of counter `[index, 0, 0, 0]` under the seed's two halves.
pub fn uniform_at(seed: u64, index: u64) -> f32 {
    let w = philox4x32(
        [index as u32, (index >> 32) as u32, 0, 0],
        [seed as u32, (seed >> 32) as u32],
    );
    (w[0] >> 8) as f32 * (1.0 / (1u32 << 24) as f32)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The known answers the generator's authors publish (Random123, `kat_vectors`).
    #[test]
    fn philox_gives_the_published_known_answers() {
        assert_eq!(
            philox4x32([0; 4], [0; 2]),
            [0x6627_e8d5, 0xe169_c58d, 0xbc57_ac4c, 0x9b00_dbd8]
        );
        assert_eq!(
            philox4x32([u32::MAX; 4], [u32::MAX; 2]),
            [0x408f_276d, 0x41c8_3b0e, 0xa20b_c7c6, 0x6d54_51fd]
        );
        assert_eq!(
            philox4x32(
                [0x243f_6a88, 0x85a3_08d3, 0x1319_8a2e, 0x0370_7344],
                [0xa409_3822, 0x299f_31d0]
            ),
            [0xd16c_fe09, 0x94fd_cceb, 0x5001_e420, 0x2412_6ea1]
        );
    }

    #[test]
    fn uniform_draws_are_in_range_and_fill_every_tenth() {
        let n = 100_000;
        let mut tenths = [0usize; 10];
        for i in 0..n {
            let u = uniform_at(7, i);
            assert!((0.0..1.0).contains(&u), "{u}");
            tenths[(u * 10.0) as usize] += 1;
        }
        // Each count's standard deviation is about 95: 400 is over four of them.
        assert!(
            tenths.iter().all(|&c| c.abs_diff(10_000) < 400),
            "{tenths:?}"
        );
        assert_ne!(uniform_at(7, 0), uniform_at(8, 0));
    }
}
