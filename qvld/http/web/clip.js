"use strict";
// A clip's header, read in the browser before it is sent: its frames' size and how many
// frames it has, as the daemon's decoder counts them (an MP4 or QuickTime track's sample
// count; a Matroska or WebM track's blocks). The page refuses a clip the daemon would
// refuse (GET /v1/models: clip_limits) in the daemon's words, before the upload; a clip
// whose header it cannot read is sent and the daemon decides.

const ClipHeader = (() => {
  // -- ISO base media (MP4, MOV): boxes of [size u32][type 4cc][payload] ----------------

  function* boxes(view, start, end) {
    let at = start;
    while (at + 8 <= end) {
      let size = view.getUint32(at);
      const type = String.fromCharCode(view.getUint8(at + 4), view.getUint8(at + 5),
                                       view.getUint8(at + 6), view.getUint8(at + 7));
      let header = 8;
      if (size === 1) { // a 64-bit size follows
        if (at + 16 > end) return;
        size = view.getUint32(at + 8) * 2 ** 32 + view.getUint32(at + 12);
        header = 16;
      } else if (size === 0) {
        size = end - at; // to the end of the file
      }
      if (size < header || at + size > end) return; // cut short: what there is was read
      yield {type, start: at + header, end: at + size};
      at += size;
    }
  }

  function child(view, box, type) {
    for (const inner of boxes(view, box.start, box.end)) if (inner.type === type) return inner;
    return null;
  }

  function path(view, box, types) {
    for (const type of types) {
      box = box && child(view, box, type);
    }
    return box;
  }

  function mp4(view) {
    const file = {start: 0, end: view.byteLength};
    const moov = child(view, file, "moov");
    if (!moov) return null;
    for (const trak of boxes(view, moov.start, moov.end)) {
      if (trak.type !== "trak") continue;
      const hdlr = path(view, trak, ["mdia", "hdlr"]);
      // hdlr: version and flags (4), pre_defined (4), handler type.
      if (!hdlr || hdlr.end - hdlr.start < 12 || fourcc(view, hdlr.start + 8) !== "vide") continue;
      const stbl = path(view, trak, ["mdia", "minf", "stbl"]);
      const stsd = stbl && child(view, stbl, "stsd");
      const stsz = stbl && (child(view, stbl, "stsz") || child(view, stbl, "stz2"));
      // stsd: version and flags, entry count, then the first entry: its box header (8),
      // reserved (6), data reference (2), pre_defined and reserved (16), width, height.
      if (!stsd || !stsz || stsd.end - stsd.start < 8 + 36) return null;
      const entry = stsd.start + 8;
      const width = view.getUint16(entry + 32);
      const height = view.getUint16(entry + 34);
      let frames = view.getUint32(stsz.start + 8); // version and flags, sample size, count
      if (frames === 0) frames = fragmentFrames(view, file, trackId(view, trak));
      return frames > 0 && width > 0 && height > 0 ? {width, height, frames} : null;
    }
    return null;
  }

  function fourcc(view, at) {
    return String.fromCharCode(...[0, 1, 2, 3].map((n) => view.getUint8(at + n)));
  }

  function trackId(view, trak) {
    const tkhd = child(view, trak, "tkhd");
    if (!tkhd) return -1;
    // Version 0: creation and modification times of 4 bytes each; version 1: of 8.
    return view.getUint32(tkhd.start + (view.getUint8(tkhd.start) === 1 ? 20 : 12));
  }

  // A fragmented MP4 (what a browser's recorder or a stream writes): the samples are
  // in each fragment's runs (moof > traf > trun) rather than in the sample table.
  function fragmentFrames(view, file, track) {
    let frames = 0;
    for (const moof of boxes(view, file.start, file.end)) {
      if (moof.type !== "moof") continue;
      for (const traf of boxes(view, moof.start, moof.end)) {
        if (traf.type !== "traf") continue;
        const tfhd = child(view, traf, "tfhd");
        if (!tfhd || view.getUint32(tfhd.start + 4) !== track) continue;
        for (const trun of boxes(view, traf.start, traf.end)) {
          if (trun.type === "trun") frames += view.getUint32(trun.start + 4);
        }
      }
    }
    return frames;
  }

  // -- Matroska and WebM: EBML elements of [id varint][size varint][payload] -------------

  const EBML = {
    header: 0x1A45DFA3, segment: 0x18538067, cluster: 0x1F43B675, tracks: 0x1654AE6B,
    trackEntry: 0xAE, trackNumber: 0xD7, trackType: 0x83, video: 0xE0,
    pixelWidth: 0xB0, pixelHeight: 0xBA, blockGroup: 0xA0, block: 0xA1, simpleBlock: 0xA3,
  };

  // A variable-length integer: the leading zeros of its first byte say its length.
  function varint(view, at, keepMarker) {
    if (at >= view.byteLength) return null;
    const first = view.getUint8(at);
    let length = 1;
    while (length <= 8 && !(first & (0x80 >> (length - 1)))) length += 1;
    if (length > 8 || at + length > view.byteLength) return null;
    let value = keepMarker ? first : first & (0xFF >> length);
    let allOnes = value === (0xFF >> length);
    for (let n = 1; n < length; n += 1) {
      const byte = view.getUint8(at + n);
      value = value * 256 + byte;
      allOnes = allOnes && byte === 0xFF;
    }
    return {value, length, unknown: !keepMarker && allOnes};
  }

  function element(view, at) {
    const id = varint(view, at, true);
    const size = id && varint(view, at + id.length, false);
    if (!size) return null;
    const start = at + id.length + size.length;
    return {id: id.value, start, end: size.unknown ? null : start + size.value};
  }

  function uint(view, el) {
    let value = 0;
    for (let at = el.start; at < el.end; at += 1) value = value * 256 + view.getUint8(at);
    return value;
  }

  function children(view, start, end) {
    const out = [];
    for (let at = start; at < end;) {
      const el = element(view, at);
      if (!el || el.end === null || el.end > end) break;
      out.push(el);
      at = el.end;
    }
    return out;
  }

  function videoTrack(view, tracks) {
    for (const entry of children(view, tracks.start, tracks.end)) {
      if (entry.id !== EBML.trackEntry) continue;
      const fields = children(view, entry.start, entry.end);
      const type = fields.find((f) => f.id === EBML.trackType);
      if (!type || uint(view, type) !== 1) continue; // 1: video
      const number = fields.find((f) => f.id === EBML.trackNumber);
      const video = fields.find((f) => f.id === EBML.video);
      const size = video ? children(view, video.start, video.end) : [];
      const width = size.find((f) => f.id === EBML.pixelWidth);
      const height = size.find((f) => f.id === EBML.pixelHeight);
      if (!number || !width || !height) return null;
      return {number: uint(view, number), width: uint(view, width), height: uint(view, height)};
    }
    return null;
  }

  // The segment and its clusters are entered rather than skipped (a recorder writes
  // them with an unknown size); everything else is skipped by its size. Each block of
  // the video track is a frame (a laced block: as many as it holds).
  function matroska(view) {
    let track = null;
    let frames = 0;
    for (let at = 0; at < view.byteLength;) {
      const el = element(view, at);
      if (!el) break;
      if (el.id === EBML.segment || el.id === EBML.cluster || el.id === EBML.blockGroup) {
        at = el.start;
        continue;
      }
      if (el.end === null || el.end > view.byteLength) break; // cut short
      if (el.id === EBML.tracks && !track) {
        track = videoTrack(view, el);
        if (!track) return null;
      } else if ((el.id === EBML.simpleBlock || el.id === EBML.block) && track) {
        const number = varint(view, el.start, false);
        if (number && number.value === track.number) {
          const flags = view.getUint8(el.start + number.length + 2);
          frames += flags & 0x06 ? view.getUint8(el.start + number.length + 3) + 1 : 1;
        }
      }
      at = el.end;
    }
    return track && frames > 0 ? {width: track.width, height: track.height, frames} : null;
  }

  // -- the page's side ------------------------------------------------------------------

  // {width, height, frames} of a clip (a Blob), or null where its header is not read.
  async function read(blob) {
    try {
      const view = new DataView(await blob.arrayBuffer());
      if (view.byteLength < 12) return null;
      if (view.getUint32(0) === EBML.header) return matroska(view);
      return mp4(view);
    } catch (error) {
      return null; // a header past what this reads: the daemon decides
    }
  }

  const grouped = (n) => n.toLocaleString("en-US");

  // Why the daemon would refuse a clip of this header under these limits (its words,
  // qvld/engine/inputs/video.py), or null.
  function refusal(header, limits) {
    if (!header || !limits) return null;
    const {width, height, frames} = header;
    const pixels = width * height;
    if (limits.max_frame_pixels && pixels > limits.max_frame_pixels) {
      return `the video's frames are ${width}x${height} pixels; at most ` +
             `${limits.max_frame_pixels} are decoded (engine.max_decode_pixels)`;
    }
    if (limits.max_frames && frames > limits.max_frames) {
      return `the video has over ${limits.max_frames} frames; send a shorter clip`;
    }
    // Decoded: every frame up to the last one sampled, which is the last one (a clip
    // of one frame decodes that one).
    const decoded = frames * pixels;
    if (limits.max_decoded_pixels && decoded > limits.max_decoded_pixels) {
      return `the video would have ${frames} frames of ${width}x${height} decoded ` +
             `(${grouped(decoded)} pixels); at most ${grouped(limits.max_decoded_pixels)} ` +
             "are decoded for one clip (engine.max_clip_decode_pixels): send a shorter or " +
             "smaller one";
    }
    return null;
  }

  return {read, refusal};
})();
