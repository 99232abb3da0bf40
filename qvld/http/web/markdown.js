"use strict";
// The model's markdown as DOM nodes: paragraphs, headings, lists, tables, block quotes,
// code blocks (with a Copy button), inline code, emphasis and links. Built with
// createElement and text nodes only: model output never reaches innerHTML, so nothing it
// writes can become markup, a script or a request. Links keep http(s) and mailto targets
// (rel=noopener noreferrer); an image is shown as a link to it, never loaded. An
// unfinished answer (a fence not closed yet) renders as far as it goes.

const Markdown = (() => {
  const FENCE = /^ {0,3}(`{3,}|~{3,})\s*([^`\s]*)/;
  const HEADING = /^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$/;
  const RULE = /^ {0,3}([-*_])(\s*\1){2,}\s*$/;
  const QUOTE = /^ {0,3}> ?(.*)$/;
  const ITEM = /^( *)([-*+]|\d{1,9}[.)])\s+(.*)$/;
  const TABLE_RULE = /^\s*\|?\s*:?-+:?\s*(\|\s*:?-+:?\s*)*\|?\s*$/;
  const SAFE_URL = /^(https?:|mailto:)/i;
  // One inline pattern, tried left to right; the groups say which kind matched.
  const INLINE = new RegExp([
    /(`+)([^`]|[^`][\s\S]*?[^`])\1(?!`)/.source, // 1,2: code
    /(!?)\[([^\]]*)\]\(\s*<?((?:[^()\s<>]|\([^()\s]*\))+)>?(?:\s+"[^"]*")?\s*\)/.source, // 3,4,5: link, image
    /\*\*(?=\S)([\s\S]*?\S)\*\*/.source, // 6: strong
    /__(?=\S)([\s\S]*?\S)__(?!\w)/.source, // 7: strong
    /~~(?=\S)([\s\S]*?\S)~~/.source, // 8: deleted
    /\*(?=[^\s*])([\s\S]*?[^\s*])\*/.source, // 9: emphasis
    /(?<!\w)_(?=[^\s_])([\s\S]*?[^\s_])_(?!\w)/.source, // 10: emphasis
    /(https?:\/\/[^\s<>()]*[^\s<>().,;:!?'"])/.source, // 11: a bare link
    /\\([\\`*_{}[\]()#+\-.!|~>])/.source, // 12: an escaped character
  ].join("|"), "g");

  function el(tag, className, ...children) {
    const node = document.createElement(tag);
    if (className) node.className = className;
    node.append(...children);
    return node;
  }

  function link(text, url) {
    if (!SAFE_URL.test(url)) return document.createTextNode(text);
    const a = el("a", "", text);
    a.href = url;
    a.rel = "noopener noreferrer";
    a.target = "_blank";
    return a;
  }

  function inline(text, into) {
    let last = 0;
    INLINE.lastIndex = 0;
    for (const m of text.matchAll(INLINE)) {
      if (m.index > last) into.append(lineBreaks(text.slice(last, m.index)));
      last = m.index + m[0].length;
      if (m[1] !== undefined) {
        into.append(el("code", "", m[2].replace(/^ (.*) $/s, "$1")));
      } else if (m[3] !== undefined) {
        const node = link(m[3] ? (m[4] || m[5]) : "", m[5]);
        if (m[3]) into.append(node); // an image: a link to it, never loaded
        else if (node.nodeType === Node.TEXT_NODE) inline(m[4], into);
        else {
          node.textContent = "";
          inline(m[4], node);
          into.append(node);
        }
      } else if (m[6] !== undefined || m[7] !== undefined) {
        into.append(inline(m[6] ?? m[7], el("strong")));
      } else if (m[8] !== undefined) {
        into.append(inline(m[8], el("del")));
      } else if (m[9] !== undefined || m[10] !== undefined) {
        into.append(inline(m[9] ?? m[10], el("em")));
      } else if (m[11] !== undefined) {
        into.append(link(m[11], m[11]));
      } else {
        into.append(m[12]);
      }
    }
    if (last < text.length) into.append(lineBreaks(text.slice(last)));
    return into;
  }

  // A line break inside a paragraph is kept (chat answers mean them).
  function lineBreaks(text) {
    const out = document.createDocumentFragment();
    text.split("\n").forEach((part, i) => {
      if (i) out.append(el("br"));
      out.append(part);
    });
    return out;
  }

  function cells(line) {
    let row = line.trim();
    if (row.startsWith("|")) row = row.slice(1);
    if (row.endsWith("|") && !row.endsWith("\\|")) row = row.slice(0, -1);
    return row.split(/(?<!\\)\|/).map((cell) => cell.trim().replace(/\\\|/g, "|"));
  }

  function table(header, rule, rows) {
    const aligns = cells(rule).map((c) => c.startsWith(":") && c.endsWith(":") ? "center"
      : c.endsWith(":") ? "right" : c.startsWith(":") ? "left" : "");
    const row = (line, tag) => {
      const tr = el("tr");
      const values = cells(line);
      aligns.forEach((align, i) => {
        const cell = inline(values[i] || "", el(tag));
        if (align) cell.style.textAlign = align;
        tr.append(cell);
      });
      return tr;
    };
    const body = el("tbody", "", ...rows.map((line) => row(line, "td")));
    return el("div", "table", el("table", "", el("thead", "", row(header, "th")), body));
  }

  function codeBlock(lang, text) {
    const bar = el("div", "code-bar", el("span", "", lang || "code"));
    const copy = el("button", "copy-code", "Copy");
    copy.type = "button";
    copy.setAttribute("aria-label", `Copy the ${lang || "code"} block`);
    bar.append(copy);
    return el("div", "code", bar, el("pre", "", el("code", "", text)));
  }

  function blocks(lines, into) {
    let i = 0;
    let paragraph = [];
    const flush = () => {
      if (paragraph.length) into.append(inline(paragraph.join("\n"), el("p")));
      paragraph = [];
    };
    while (i < lines.length) {
      const line = lines[i];
      let m;
      if ((m = FENCE.exec(line))) {
        flush();
        const close = new RegExp(`^ {0,3}${m[1][0]}{${m[1].length},}\\s*$`);
        const body = [];
        for (i += 1; i < lines.length && !close.test(lines[i]); i += 1) body.push(lines[i]);
        into.append(codeBlock(m[2], body.join("\n")));
        i += 1;
      } else if (!line.trim()) {
        flush();
        i += 1;
      } else if ((m = HEADING.exec(line))) {
        flush();
        into.append(inline(m[2], el(`h${Math.min(6, m[1].length + 2)}`)));
        i += 1;
      } else if (RULE.test(line) && !paragraph.length) {
        into.append(el("hr"));
        i += 1;
      } else if (QUOTE.test(line)) {
        flush();
        const body = [];
        for (; i < lines.length && (m = QUOTE.exec(lines[i])); i += 1) body.push(m[1]);
        into.append(blocks(body, el("blockquote")));
      } else if (line.includes("|") && i + 1 < lines.length && TABLE_RULE.test(lines[i + 1])
                 && lines[i + 1].includes("-")) {
        flush();
        const rows = [];
        let j = i + 2;
        for (; j < lines.length && lines[j].includes("|") && lines[j].trim(); j += 1) {
          rows.push(lines[j]);
        }
        into.append(table(line, lines[i + 1], rows));
        i = j;
      } else if ((m = ITEM.exec(line)) && (!paragraph.length || m[1].length === 0)) {
        flush();
        i = list(lines, i, into);
      } else {
        paragraph.push(line.trim());
        i += 1;
      }
    }
    flush();
    return into;
  }

  // A list from lines[i]: items at this indent; lines indented more belong to the item
  // above (nested lists, continued text). Returns the index after the list.
  function list(lines, i, into) {
    const first = ITEM.exec(lines[i]);
    const indent = first[1].length;
    const ordered = /\d/.test(first[2]);
    const node = el(ordered ? "ol" : "ul");
    if (ordered && parseInt(first[2], 10) !== 1) node.start = parseInt(first[2], 10);
    while (i < lines.length) {
      const m = ITEM.exec(lines[i]);
      if (!m || m[1].length !== indent || /\d/.test(m[2]) !== ordered) break;
      const body = [m[3]];
      let j = i + 1;
      for (; j < lines.length; j += 1) {
        const next = lines[j];
        if (!next.trim()) {
          const after = lines[j + 1];
          if (after !== undefined && after.length - after.trimStart().length > indent) {
            body.push("");
            continue;
          }
          break;
        }
        const lead = next.length - next.trimStart().length;
        if (lead <= indent && (ITEM.test(next) || FENCE.test(next) || HEADING.test(next))) break;
        body.push(lead > indent ? next.slice(Math.min(lead, indent + 2)) : next.trim());
      }
      const item = el("li");
      // A single line stays inline (no <p> inside a tight list item).
      if (body.length === 1) inline(body[0], item);
      else blocks(body, item);
      node.append(item);
      i = j;
    }
    into.append(node);
    return i;
  }

  function render(text) {
    return blocks(text.replace(/\r\n?/g, "\n").split("\n"), document.createDocumentFragment());
  }

  return {render};
})();
